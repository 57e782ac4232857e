"""The TCP data plane against a chunk server in another process, over real sockets."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
from collections.abc import Callable

import pytest
from kv_offload_sidecar.data import IntegrityError, TransportError, connect, make_server
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.store.chunk_store import ChunkStore
from peer_processes import PeerProcess
from prometheus_client import CollectorRegistry
from raw_wire import authenticated as raw_authenticated
from raw_wire import dial as raw_connect
from raw_wire import error_text, read_frame, read_until_closed
from transport_peers import (SESSION_ID, SESSION_KEY, assert_nothing_partial, assert_still_serves, chunk_bytes_in,
                             content_of, hold_chunks, key_of, kill_at_first_chunk, session)

CHUNK = 256 * 1024


# ------------------------------------------------------------------ raw sockets


# ------------------------------------------------------------------ behaviour


async def test_fetch_moves_chunks_byte_identical_into_store_slots(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=16, chunk_bytes=CHUNK)
    registry = CollectorRegistry()
    metrics = SidecarMetrics(registry)
    store = make_store(metrics=metrics)
    keys = [key_of(i) for i in range(16)]
    async with session(peer.address, metrics=metrics) as client:
        assert await client.fetch(keys, store, timeout=10) == 16
    for i, key in enumerate(keys):
        assert chunk_bytes_in(store, key) == content_of(i, CHUNK)
    assert_nothing_partial(store, CHUNK)
    assert metrics.peer_bytes.labels(direction="received")._value.get() == 16 * CHUNK
    assert metrics.peer_fetches.labels(result="ok")._value.get() == 1
    assert peer.metrics()["peer_bytes_sent"] == 16 * CHUNK


async def test_lookup_returns_the_leading_hit_prefix(start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=8, chunk_bytes=CHUNK)
    keys = [key_of(i) for i in range(8)]
    async with session(peer.address) as client:
        assert await client.lookup(keys, timeout=5) == 8
        assert await client.lookup(keys[:3] + [key_of(999)] + keys[3:], timeout=5) == 3
        assert await client.lookup([key_of(999)] + keys, timeout=5) == 0
        many = await asyncio.gather(*(client.lookup(keys[:n], timeout=5) for n in range(1, 9)))
        assert many == list(range(1, 9))  # concurrent lookups on one connection


async def test_large_chunks_back_to_back_land_whole_and_a_miss_behind_them_ends_the_prefix(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    # Chunks of 1 MiB or more arrive on the connection's thread, which reads the frame after
    # each while more are due (a CHUNK's header and prefix, or here the CHUNK_MISSING).
    big = 2 << 20
    peer = start_peer("tcp", chunks=6, chunk_bytes=big)
    store = make_store(slots=8, chunk_bytes=big)
    keys = [key_of(i) for i in range(6)]
    async with session(peer.address) as client:
        assert await client.fetch(keys + [key_of(999), key_of(0)], store, timeout=20) == 6
        assert await client.lookup(keys, timeout=5) == 6  # the connection still reads its replies
        assert await client.fetch([key_of(999)], store, timeout=5) == 0
    for i, key in enumerate(keys):
        assert chunk_bytes_in(store, key) == content_of(i, big)
    assert_nothing_partial(store, big)


async def test_fetch_stops_at_a_key_the_peer_does_not_hold(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=CHUNK)
    store = make_store()
    async with session(peer.address) as client:
        assert await client.fetch([key_of(0), key_of(999), key_of(1)], store, timeout=5) == 1
        assert not store.contains(key_of(999))
        # the connection stays usable after a miss
        assert await client.fetch([key_of(2), key_of(3)], store, timeout=5) == 2
    assert_nothing_partial(store, CHUNK)


async def test_keys_already_in_the_store_are_not_fetched_again(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=CHUNK)
    store = make_store()
    async with session(peer.address) as client:
        assert await client.fetch([key_of(0), key_of(1)], store, timeout=5) == 2
        sent = peer.metrics()["peer_bytes_sent"]
        assert await client.fetch([key_of(0), key_of(1), key_of(2)], store, timeout=5) == 3
        assert peer.metrics()["peer_bytes_sent"] - sent == CHUNK


async def test_the_open_says_it_reached_the_holder_once_its_tcp_connection_is_made_before_the_proof(
        start_peer: Callable[..., PeerProcess]) -> None:
    # A holder whose process answers nothing (it accepts, the kernel does that, and stays
    # silent) is reached all the same; the open then fails at its deadline.
    silent = socket.create_server(("127.0.0.1", 0))
    reached: list[str] = []
    try:
        with pytest.raises(TransportError, match="deadline"):
            await connect(f"tcp://127.0.0.1:{silent.getsockname()[1]}", SESSION_ID, SESSION_KEY,
                          timeout=0.3, reached=lambda: reached.append("silent"))
    finally:
        silent.close()
    assert reached == ["silent"]
    peer = start_peer("tcp", chunks=1, chunk_bytes=CHUNK)
    async with session(peer.address, lanes=2, reached=lambda: reached.append("laned")) as client:
        assert await client.lookup([key_of(0)], timeout=5) == 1
    assert reached == ["silent", "laned", "laned", "laned"]  # the control connection and 2 lanes


async def test_wrong_session_key_is_refused_before_any_chunk_byte(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=CHUNK)
    with pytest.raises(TransportError, match="unauthenticated"):
        await connect(peer.address, SESSION_ID, b"not-the-key", timeout=5)
    # Raw: a wrong proof followed by a FETCH gets the challenge, one ERROR and EOF, no chunk.
    sock = raw_connect(peer.address)
    header, nonce = read_frame(sock)
    sock.sendall(proto.join(proto.encode_auth_response(SESSION_ID, auth_proof(b"wrong", nonce)))
                 + proto.join(proto.encode_fetch(1, [key_of(0)])))
    rest = read_until_closed(sock)
    sock.close()
    assert "unauthenticated" in error_text(rest)
    assert len(rest) < 1024  # no chunk bytes
    # Raw: asking before answering the nonce is refused too.
    sock = raw_connect(peer.address)
    read_frame(sock)
    sock.sendall(proto.join(proto.encode_fetch(1, [key_of(0)])))
    rest = read_until_closed(sock)
    sock.close()
    assert "unauthenticated" in error_text(rest) and len(rest) < 1024
    assert peer.metrics()["protocol_errors"]["unauthenticated"] == 3


async def test_bad_frames_get_clear_errors_and_the_server_keeps_serving_others(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=CHUNK)
    good = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    cases = {
        "malformed": b"JUNK" + bytes(12),
        "oversize": proto.encode_header(proto.MessageType.LOOKUP, 1, 1 << 40),
        "unknown_type": struct.pack("!2sBBIQ", b"KO", 1, 99, 1, 0),
        "bad_key": proto.encode_header(proto.MessageType.FETCH, 1, 6) + struct.pack("!IH", 1, 0),
        "bad_size": proto.encode_header(proto.MessageType.CHUNK, 1, 3 * CHUNK),
    }
    for reason, frame in cases.items():
        sock = raw_authenticated(peer.address)
        sock.sendall(frame)
        text = error_text(read_until_closed(sock))
        sock.close()
        assert text.startswith(reason + ":"), text
    # Truncated: a header promising a payload that never comes, then the client vanishes.
    sock = raw_authenticated(peer.address)
    sock.sendall(proto.encode_header(proto.MessageType.LOOKUP, 1, 100) + b"\x00\x00")
    sock.close()
    # The well-behaved client, connected before all this, is still served.
    store = make_store()
    try:
        assert await good.fetch([key_of(i) for i in range(4)], store, timeout=5) == 4
    finally:
        await good.close()
    assert_nothing_partial(store, CHUNK)
    errors = peer.metrics()["protocol_errors"]
    assert {r: errors[r] for r in cases} == dict.fromkeys(cases, 1.0)
    assert peer.alive()


async def test_frame_stalled_mid_payload_is_refused_and_others_still_served(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK, auth_timeout=1.0)
    sock = raw_authenticated(peer.address)
    sock.sendall(proto.encode_header(proto.MessageType.LOOKUP, 1, 100) + b"\x00\x00")  # then silence
    text = error_text(read_until_closed(sock))
    sock.close()
    assert text.startswith("malformed:") and "stalled" in text
    await assert_still_serves(peer.address, make_store())


async def test_server_killed_mid_fetch_fails_within_deadline_leaving_nothing_partial(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    big = 1 << 20
    peer = start_peer("tcp", chunks=48, chunk_bytes=big)
    store = make_store(slots=50, chunk_bytes=big, on_change=kill_at_first_chunk(peer.pid))
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    with pytest.raises(TransportError) as failed:
        await client.fetch([key_of(i) for i in range(48)], store, timeout=5)
    assert "deadline" not in str(failed.value)  # it ended with the connection, not by the deadline
    assert client.closed and peer.proc.wait(5) == -signal.SIGKILL  # killed at the first chunk
    assert 1 <= len(store) < 48
    assert_nothing_partial(store, big)


async def test_corrupted_chunk_fails_its_checksum_and_is_not_stored(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=CHUNK, corrupt="1")
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(metrics=metrics)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, metrics=metrics)
    with pytest.raises(IntegrityError, match=key_of(1).hex()):
        await client.fetch([key_of(i) for i in range(4)], store, timeout=5)
    assert not store.contains(key_of(1))
    assert store.contains(key_of(0))
    assert metrics.integrity_failures._value.get() == 1
    assert metrics.peer_fetches.labels(result="integrity")._value.get() == 1
    assert_nothing_partial(store, CHUNK)


async def test_chunk_of_another_size_is_refused_and_nothing_stored(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK)
    store = make_store(chunk_bytes=CHUNK // 2)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    with pytest.raises(TransportError, match="bad_size"):
        await client.fetch([key_of(0)], store, timeout=5)
    assert len(store) == 0 and store.used_bytes == 0


async def silent_server(
        reply: Callable[[socket.socket, bytes], None] | None = None) -> tuple[str, asyncio.AbstractServer]:
    """A real TCP server that authenticates anyone, then answers with ``reply`` (or never)."""
    return await split_reply_server(lambda header: [] if reply is None else [reply(header)])  # type: ignore[arg-type]


async def test_fetch_past_its_deadline_becomes_an_error_and_frees_its_slots(
        make_store: Callable[..., ChunkStore]) -> None:
    address, server = await silent_server()
    store = make_store()
    try:
        client = await connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        with pytest.raises(TransportError, match="deadline"):
            await client.fetch([key_of(i) for i in range(4)], store, timeout=0.5)
        assert store.used_bytes == 0 and len(store) == 0
        with pytest.raises(TransportError, match="closed"):
            await client.lookup([key_of(0)], timeout=1)
    finally:
        server.close()


async def test_a_lookup_answered_after_its_spin_or_in_pieces_is_answered_by_the_reader() -> None:
    # The holder runs on this test's loop: its reply can only come once the lookup stopped
    # spinning for it (the reader task answers it then), and here in two pieces.
    def counted(header: proto.Header) -> list[bytes]:
        reply = proto.join(proto.encode_lookup_reply(header.request_id, 1))
        return [reply[:5], reply[5:]]

    address, server = await split_reply_server(counted)
    try:
        client = await connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        assert await client.lookup([key_of(0), key_of(1)], timeout=5) == 1
        await client.close()
    finally:
        server.close()


async def test_a_lookup_never_answered_fails_at_its_deadline() -> None:
    address, server = await silent_server()
    try:
        client = await connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        with pytest.raises(TransportError, match="deadline"):
            await client.lookup([key_of(0)], timeout=0.3)
        with pytest.raises(TransportError):
            await client.lookup([key_of(0)], timeout=1)  # the connection ended with it
    finally:
        server.close()


async def split_reply_server(
        reply: Callable[[proto.Header], list[bytes]]) -> tuple[str, asyncio.AbstractServer]:
    """A real TCP server that authenticates anyone, then answers its first frame with the
    pieces ``reply`` gives, each written once the one before it was sent."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(proto.join(proto.encode_auth_challenge(bytes(16))))
        await reader.readexactly(proto.HEADER_BYTES + 2 + len(SESSION_ID) + 32)
        writer.write(proto.join(proto.encode_auth_ok()))
        head = await reader.readexactly(proto.HEADER_BYTES)
        header = proto.decode_header(head)
        await reader.readexactly(header.length)
        for piece in reply(header):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)  # a loop turn between the pieces
        await reader.read()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return f"tcp://127.0.0.1:{port}", server


async def test_unrequested_chunk_from_a_server_is_refused(make_store: Callable[..., ChunkStore]) -> None:
    def wrong_chunk(header: proto.Header) -> bytes:
        return proto.join(proto.encode_chunk(header.request_id, key_of(7), 0, memoryview(bytes(CHUNK))))

    address, server = await silent_server(wrong_chunk)  # type: ignore[arg-type]
    store = make_store()
    try:
        client = await connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        with pytest.raises(TransportError, match="bad_key"):
            await client.fetch([key_of(0)], store, timeout=5)
        assert store.used_bytes == 0 and not store.contains(key_of(7))
    finally:
        server.close()


async def test_in_process_server_serves_what_a_store_holds(make_store: Callable[..., ChunkStore]) -> None:
    source = make_store()
    hold_chunks(source, 3, CHUNK)
    metrics = SidecarMetrics(CollectorRegistry())
    server = make_server("tcp", source, {SESSION_ID: SESSION_KEY}.get, metrics, chunk_bytes=CHUNK)
    address = await server.start()
    assert address.startswith("tcp://127.0.0.1:")
    dest = make_store()
    try:
        async with session(address) as client:
            assert await client.fetch([key_of(i) for i in range(3)], dest, timeout=5) == 3
    finally:
        await server.stop(0.5)
    assert_nothing_partial(dest, CHUNK)
    assert metrics.peer_bytes.labels(direction="sent")._value.get() == 3 * CHUNK


def test_unknown_transport_and_address_are_named() -> None:
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        make_server("rdma", None, lambda s: None, None, chunk_bytes=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not tcp://host:port, tls://host:port, ucx://<worker address> "
                                         "or nixl://host:port"):
        asyncio.run(connect("http://x:1", SESSION_ID, SESSION_KEY, timeout=1))
