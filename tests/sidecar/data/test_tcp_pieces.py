"""The plain TCP receive hands each piece on as it lands: what the client hashes a chunk with
(so its slot is not read back from memory a second time)."""

from __future__ import annotations

import asyncio
import os
import socket

from kv_offload_sidecar.data.tcp.client import RECV_BATCH_BYTES, RECV_PIECE_BYTES
from kv_offload_sidecar.data.tcp.sockets import recv_exactly, tune_socket
from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES, chunk_checksum, chunk_hasher


async def _receive_in_pieces(a: socket.socket, b: socket.socket, data: bytes,
                             **kwargs: int) -> tuple[bytearray, list[int], int]:
    """Send ``data`` on ``a`` and receive it on ``b`` with ``recv_exactly(**kwargs)``:
    the bytes received, each piece's size and the digest of the pieces in order."""
    loop = asyncio.get_running_loop()
    dest = bytearray(len(data))
    hasher, sizes = chunk_hasher(), []

    def on_piece(piece: memoryview) -> None:
        sizes.append(len(piece))
        hasher.update(piece)

    try:
        sending = asyncio.ensure_future(loop.sock_sendall(a, data))
        await asyncio.wait_for(recv_exactly(loop, b, dest, on_piece=on_piece, **kwargs), 60)
        await sending
    finally:
        a.close()
        b.close()
    return dest, sizes, hasher.intdigest()


async def test_the_pieces_handed_on_are_the_received_bytes_in_order_and_hash_as_the_whole() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    data = os.urandom(3 * CACHED_PIECE_BYTES + 12345)
    dest, sizes, digest = await _receive_in_pieces(a, b, data, batch_bytes=512 << 10)
    assert dest == data
    assert sum(sizes) == len(data) and max(sizes) <= CACHED_PIECE_BYTES
    assert digest == chunk_checksum(data)


async def test_the_clients_batch_and_piece_sizes_complete_a_chunk_over_tcp_in_pieces_of_at_most_their_size() -> None:
    # The client's SO_RCVLOWAT batch must always be reached on a real TCP connection (a
    # low-water mark the receive buffer cannot hold would never wake the loop), and no piece
    # handed to the hasher may be larger than the client asked for.
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    tune_socket(a)
    tune_socket(b)
    data = os.urandom(2 * RECV_PIECE_BYTES + 3 * RECV_BATCH_BYTES + 4321)
    dest, sizes, digest = await _receive_in_pieces(a, b, data, batch_bytes=RECV_BATCH_BYTES,
                                                   piece_bytes=RECV_PIECE_BYTES)
    assert dest == data
    assert sum(sizes) == len(data) and max(sizes) <= RECV_PIECE_BYTES
    assert digest == chunk_checksum(data)
