"""The plain TCP receive hands each piece on as it lands: what the client hashes a chunk with
(so its slot is not read back from memory a second time)."""

from __future__ import annotations

import asyncio
import os
import socket

from kv_offload_sidecar.data.tcp.sockets import recv_exactly
from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES
from kv_offload_sidecar.store.checksum import chunk_checksum, chunk_hasher


async def test_the_pieces_handed_on_are_the_received_bytes_in_order_and_hash_as_the_whole() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    data = os.urandom(3 * CACHED_PIECE_BYTES + 12345)
    dest = bytearray(len(data))
    hasher, sizes = chunk_hasher(), []

    def on_piece(piece: memoryview) -> None:
        sizes.append(len(piece))
        hasher.update(piece)

    try:
        sending = asyncio.ensure_future(loop.sock_sendall(a, data))
        await recv_exactly(loop, b, dest, batch_bytes=512 << 10, on_piece=on_piece)
        await sending
    finally:
        a.close()
        b.close()
    assert dest == data
    assert sum(sizes) == len(data) and max(sizes) <= CACHED_PIECE_BYTES
    assert hasher.intdigest() == chunk_checksum(data)
