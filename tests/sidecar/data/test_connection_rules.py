"""The rules of authenticated data connections (``data.serving.ProvenConnections``,
``keepalive``, ``FramedPeerDataClient.ping``): a retired key ends its open connections, a
session holds a bounded number, a silent one is closed by its server, a heartbeat fails
when the holder goes silent, and every socket carries the kernel's keepalive."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from kv_offload_testing.frozen import freeze
from kv_offload_sidecar.data import TransportError, make_server
from kv_offload_sidecar.data import serving
from kv_offload_sidecar.data.base import PeerBusy
from kv_offload_sidecar.data.protocol import ProtocolError
from kv_offload_sidecar.data.serving import DEFAULT_CONNECTIONS_PER_SESSION
from kv_offload_sidecar.data.tcp.client import TcpPeerDataClient
from kv_offload_sidecar.keepalive import USER_TIMEOUT_SECONDS
from kv_offload_sidecar.peers.liveness import LOST_AFTER_SECONDS, lanes_of
from kv_offload_sidecar.store.chunk_store import ChunkStore
from peer_processes import PeerProcess
from transport_peers import SESSION_ID, SESSION_KEY, session
from waiting import wait_for, wait_for_async


async def test_a_retired_key_ends_the_open_data_connections_of_its_sessions(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2)
    async with session(peer.address) as client:
        assert await client.ping(1.0) < 1.0
        peer.ask("end_sessions")  # what InboundSessions.get answers once a retired key's grace ran out
        await wait_for_async("the ended session's connection closed", lambda: client.closed,
                             timeout=serving.SWEEP_SECONDS + 3.0)
    # Each of its connections (the control connection and the lane).
    assert peer.metrics()["protocol_errors"]["unauthenticated"] == len(lanes_of(client)) == 2


async def test_a_session_holds_at_most_its_bound_of_connections_and_one_more_is_refused_and_counted(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2)
    clients = [await TcpPeerDataClient.connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
               for _ in range(DEFAULT_CONNECTIONS_PER_SESSION)]
    try:
        # Refused as a busy holder (PeerBusy): its reader takes it as a miss, not a failure.
        with pytest.raises(PeerBusy, match="too_many_connections.*connections_per_session=11"):
            await TcpPeerDataClient.connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
        assert peer.metrics()["protocol_errors"]["too_many_connections"] == 1
        await clients.pop().close()  # a place is free again
        await wait_for_async("a new connection of the session admitted", lambda: _connects(peer))
    finally:
        for c in clients:
            await c.close()


_opened: list = []


async def _connects(peer: PeerProcess) -> bool:
    try:
        _opened.append(await TcpPeerDataClient.connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5))
    except TransportError:
        return False
    await _opened.pop().close()
    return True


async def test_a_connection_that_receives_nothing_is_closed_and_one_that_is_pinged_is_not(
        shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "SILENT_CLOSE_SECONDS", 0.6)
    store = ChunkStore(4096, 1 << 20, directory=shm_dir, name=f"silent-{os.getpid()}")
    server = make_server("tcp", store, {SESSION_ID: SESSION_KEY}.get, None, chunk_bytes=4096)
    address = await server.start()
    try:
        idle = await TcpPeerDataClient.connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        pinged = await TcpPeerDataClient.connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        started = time.monotonic()
        while not idle.closed:
            assert time.monotonic() - started < 0.6 + serving.SWEEP_SECONDS + 2.0, "the idle one stayed open"
            await pinged.ping(1.0)
            await asyncio.sleep(0.1)
        assert time.monotonic() - started >= 0.6
        assert not pinged.closed
        await pinged.close()
    finally:
        await server.stop(0.2)
        store.close()


async def test_a_heartbeat_fails_once_the_holder_is_silent_for_the_lost_after_time(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2)
    async with session(peer.address) as client:
        assert await client.ping(LOST_AFTER_SECONDS) < LOST_AFTER_SECONDS
        freeze(peer.pid)  # alive, connected, silent
        try:
            started = time.monotonic()
            with pytest.raises(TransportError, match="silent"):
                async with asyncio.timeout(LOST_AFTER_SECONDS + 2.0):  # a hang fails too
                    await client.ping(LOST_AFTER_SECONDS)
            took = time.monotonic() - started
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        assert LOST_AFTER_SECONDS <= took < LOST_AFTER_SECONDS + 0.5
        assert client.closed


async def test_both_ends_of_a_data_connection_carry_keepalive_and_a_user_timeout(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2)
    async with session(peer.address) as client:
        for connection in lanes_of(client):  # the control connection and the lane
            sock = connection._stream.sock
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == USER_TIMEOUT_SECONDS * 1000
        # The server's end (another process): ss shows its keepalive timer once its last
        # frame was acknowledged (a retransmission timer until then).
        port = peer.address.rsplit(":", 1)[1]
        wait_for("the server's end on a keepalive timer", lambda: "timer:(keepalive" in subprocess.run(
            ["ss", "-tnoH", "state", "established", f"( sport = :{port} )"],
            capture_output=True, text=True, check=True).stdout)


def test_a_holder_serves_at_most_its_bound_of_sessions_and_a_closed_one_frees_a_place() -> None:
    class Conn(SimpleNamespace):
        __hash__ = object.__hash__

    def conn(session: bytes) -> Conn:
        return Conn(session_id=session, heard=time.monotonic())

    proven = serving.ProvenConnections(lambda session_id: True, per_session=4, max_sessions=2)
    a, b = conn(b"a" * 16), conn(b"b" * 16)
    proven.admit(a)
    proven.admit(b)
    proven.admit(conn(b"a" * 16))  # another lane of a session served already
    third = conn(b"c" * 16)
    with pytest.raises(ProtocolError, match="too_many_connections: this holder serves 2 peers"):
        proven.admit(third)
    proven.leave(b)  # the reader closed its idle link
    proven.admit(third)
    assert serving.MAX_SERVED_SESSIONS == 64 and len(proven) == 3
