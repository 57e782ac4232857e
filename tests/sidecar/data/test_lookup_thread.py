"""A holder's lookup-only connection answered on a thread of its own (``data.tcp.lookup_thread``):
LOOKUPs answered while the event loop is blocked, the first FETCH handing the connection to the
loop's reader (a LOOKUP sent right before it answered first), a stopping server ending the
connection with its goodbye and the thread with it, and the loop answering when no thread starts."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import pytest
from kv_offload_sidecar.data import make_server
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.tcp import lookup_thread
from kv_offload_sidecar.data.tcp.server import TcpDataPlaneServer
from kv_offload_sidecar.store.chunk_store import ChunkStore
from raw_wire import authenticated, read_frame, read_until_closed
from transport_peers import SESSION_ID, SESSION_KEY, content_of, hold_chunks, key_of
from waiting import wait_for_async

CHUNK = 4096
# The name of each connection's lookup thread.
LOOKUP_THREAD = "kv-offload-tcp-lookups"


def _lookup_threads() -> int:
    return sum(t.name == LOOKUP_THREAD for t in threading.enumerate())


@pytest.fixture
async def holder(make_store: Callable[..., ChunkStore]) -> AsyncIterator[tuple[TcpDataPlaneServer, str]]:
    """A TCP holder in this process with chunks 0..3 of ``transport_peers``."""
    store = make_store(chunk_bytes=CHUNK)
    hold_chunks(store, 4, CHUNK)
    server = make_server("tcp", store, {SESSION_ID: SESSION_KEY}.get, None, chunk_bytes=CHUNK)
    address = await server.start()
    yield server, address
    await server.stop(0.2)


def _ask(sock: socket.socket, rid: int, keys: list[bytes]) -> tuple[int, int]:
    """One LOOKUP on a raw connection: (the reply's request id, its count)."""
    sock.sendall(proto.lookup_frame(rid, keys))
    header, payload = read_frame(sock)
    assert header.type is proto.MessageType.LOOKUP_REPLY, header
    return header.request_id, proto.decode_lookup_reply(payload, len(keys))


async def test_lookups_are_answered_on_the_connections_thread_while_the_loop_is_blocked(
        holder: tuple[TcpDataPlaneServer, str]) -> None:
    _, address = holder
    sock = await asyncio.to_thread(authenticated, address)
    try:
        await wait_for_async("the connection's lookup thread", _lookup_threads)
        keys = [key_of(i) for i in range(4)]
        # Blocking calls on the loop's own thread: only the connection's thread can answer.
        assert _ask(sock, 7, keys) == (7, 4)
        assert _ask(sock, 8, keys[:2] + [key_of(99)] + keys[2:]) == (8, 2)
        assert _ask(sock, 2**32 - 1, []) == (2**32 - 1, 0)  # a heartbeat
    finally:
        sock.close()


async def test_the_first_fetch_hands_the_connection_to_the_loop_after_the_lookup_sent_before_it(
        holder: tuple[TcpDataPlaneServer, str]) -> None:
    _, address = holder
    keys = [key_of(i) for i in range(4)]

    def lookup_then_fetch() -> list[tuple[proto.MessageType, int, bytes]]:
        sock = authenticated(address)
        with sock:
            # The two frames in one send, as ``fetch.lookup_then_fetch`` writes them.
            sock.sendall(proto.lookup_frame(1, keys) + proto.join(proto.encode_fetch(10, keys[:2] + [key_of(99)])))
            frames = [read_frame(sock) for _ in range(4)]
            after = _ask(sock, 20, keys)  # lookups go on, answered on the loop now
        return [(h.type, h.request_id, p) for h, p in frames] + [(proto.MessageType.LOOKUP_REPLY, *after)]

    frames = await asyncio.to_thread(lookup_then_fetch)
    assert [(t, rid) for t, rid, _ in frames] == [
        (proto.MessageType.LOOKUP_REPLY, 1), (proto.MessageType.CHUNK, 10), (proto.MessageType.CHUNK, 11),
        (proto.MessageType.CHUNK_MISSING, 12), (proto.MessageType.LOOKUP_REPLY, 20)]
    assert proto.decode_lookup_reply(frames[0][2], 4) == 4
    for i in (0, 1):
        prefix = proto.decode_chunk_prefix(frames[1 + i][2])
        assert prefix.key == key_of(i) and frames[1 + i][2][prefix.size:] == content_of(i, CHUNK)
    assert frames[4][2] == 4
    await wait_for_async("no lookup thread left", lambda: _lookup_threads() == 0)


async def test_a_stopping_server_says_goodbye_on_a_lookup_connection_and_its_thread_ends(
        make_store: Callable[..., ChunkStore]) -> None:
    store = make_store(chunk_bytes=CHUNK)
    hold_chunks(store, 1, CHUNK)
    server = make_server("tcp", store, {SESSION_ID: SESSION_KEY}.get, None, chunk_bytes=CHUNK)
    address = await server.start()
    sock = await asyncio.to_thread(authenticated, address)
    with sock:
        assert await asyncio.to_thread(_ask, sock, 3, [key_of(0)]) == (3, 1)
        await server.stop(0.2)
        rest = await asyncio.to_thread(read_until_closed, sock)
    header = proto.decode_header(rest[:proto.HEADER_BYTES])
    assert header.type is proto.MessageType.CLOSE and len(rest) == proto.HEADER_BYTES
    await wait_for_async("no lookup thread left", lambda: _lookup_threads() == 0)


async def test_a_holder_that_cannot_start_a_thread_answers_the_lookups_on_its_loop(
        holder: tuple[TcpDataPlaneServer, str], monkeypatch: pytest.MonkeyPatch) -> None:
    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(lookup_thread, "threading", SimpleNamespace(Thread=NoThread, Lock=threading.Lock))
    _, address = holder

    def ask() -> tuple[int, int]:
        with authenticated(address) as sock:
            return _ask(sock, 5, [key_of(i) for i in range(4)])

    assert await asyncio.to_thread(ask) == (5, 4)
    assert _lookup_threads() == 0
