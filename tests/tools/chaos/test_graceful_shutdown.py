"""Graceful shutdown: SIGTERM stops accepting, lets in-flight fetches finish, leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading

from kv_offload_sidecar.data import connect
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_tools.chaos.chunks import (
    chunk_content,
    chunk_keys,
    load_and_verify,
    store_chunks,
)
from kv_offload_tools.chaos.fault_proxy import FaultPlan, FaultProxy
from kv_offload_tools.chaos.pool import chaos_pool as make_chaos_pool
from kv_offload_tools.chaos.probes import RawDataConnection, probe_handshake
from kv_offload_testing.local_pool import LocalPool
from waiting import wait_for, wait_for_async

CHUNK = 16 * 1024
# Seconds a wait for a sidecar's exit or a thread's end may take before the test gives up:
# an anti-hang bound, not an expected time.
WAIT_BOUND_SECONDS = 60.0
# Loads the SIGTERM test issues at most before it calls the loader hung.
MAX_LOADS = 100_000


def _refused(address: str) -> bool:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return False
    except OSError:
        return True


def _stopped_gracefully(pool: LocalPool, identity: str, code: int) -> None:
    """It exited 0 and left nothing behind: its shared-memory store and engine socket are unlinked."""
    assert code == 0, pool[identity].log_tail()
    assert not [p for p in os.listdir(pool.workdir) if identity in p and p.endswith((".slots", ".sock"))]


async def test_sigterm_lets_an_in_flight_fetch_finish_and_unlinks_the_store() -> None:
    # 1 MiB chunks: a 48-chunk fetch is larger than the client's request window (16 MiB), so
    # the peer keeps asking for chunks after the SIGTERM; all of them must still arrive.
    big = 1 << 20
    with make_chaos_pool(big, 64 << 20, shutdown_grace_seconds=10.0) as pool:
        server = pool.add(identity="server", peers=[])
        keys = chunk_keys("shutdown", 48)
        with server.client() as engine:
            assert store_chunks(engine, keys, big) == len(keys)
            socket_path = engine.socket_path
        status = server.status()
        store_path, data_address = status["store"]["path"], status["data_address"]
        probe = probe_handshake(server, pool.pool_key, pool.local_hello())
        host, _, port = data_address.removeprefix("tcp://").rpartition(":")
        # A slow link: the fetch of 48 MiB takes a few seconds, so SIGTERM lands in the middle.
        async with FaultProxy(host, int(port), plan=FaultPlan("delay", delay_seconds=0.002)) as proxy:
            client = await connect(proxy.address, probe.session.session_id, probe.session.session_key,
                                   timeout=5.0)
            store = ChunkStore(big, 64 << 20, directory=pool.workdir, name="probe")
            try:
                fetch = asyncio.create_task(client.fetch(keys, store, 60.0))
                await wait_for_async("8 chunks through the proxy", lambda: proxy.bytes_downstream >= 8 * big)
                assert not fetch.done()
                server.send(signal.SIGTERM)
                # It stops accepting (control and data ports) while the fetch goes on.
                await wait_for_async("control and data ports refusing after the SIGTERM",
                                     lambda: _refused(server.address) and _refused(data_address))
                got = await fetch
                assert got == len(keys), f"in-flight fetch cut short: {got} of {len(keys)} chunks"
                for key in keys:  # every chunk whole and right
                    pin = store.pin(key)
                    assert pin is not None
                    with pin:
                        assert pin.view == chunk_content(key, big)
                await client.close()
            finally:
                store.close()
        code = await asyncio.to_thread(server.proc.wait, WAIT_BOUND_SECONDS)  # type: ignore[union-attr]
        _stopped_gracefully(pool, "server", code)
        assert not os.path.exists(store_path)
        assert not os.path.exists(socket_path)


def test_sigterm_during_engine_loads_gives_whole_chunks_or_misses(chaos_pool: LocalPool) -> None:
    holder = chaos_pool.add(identity="holder", peers=[])
    loader = chaos_pool.add(identity="loader", peers=["holder"])
    keys = chunk_keys("engine-load", 64)
    with holder.client() as e_holder:
        assert store_chunks(e_holder, keys, CHUNK) == len(keys)
    e_loader = loader.client()
    wait_for("the loader seeing the holder's chunks", lambda: e_loader.lookup(keys).peer >= len(keys))
    results: list[tuple[int, int]] = []
    whole = threading.Event()  # a load got every chunk: loads work before the SIGTERM

    def loads() -> None:
        for _ in range(MAX_LOADS):  # until the SIGTERM ended the loader (the bound: a hang)
            results.append(load_and_verify(e_loader, keys, CHUNK))
            if results[-1][0] == len(keys):
                whole.set()
            if not loader.alive():
                return

    t = threading.Thread(target=loads, daemon=True)
    t.start()
    assert whole.wait(WAIT_BOUND_SECONDS), results  # SIGTERM while loads run and after one worked
    loader.send(signal.SIGTERM)
    t.join(WAIT_BOUND_SECONDS)
    assert not t.is_alive()
    assert loader.proc is not None
    _stopped_gracefully(chaos_pool, "loader", loader.proc.wait(WAIT_BOUND_SECONDS))
    assert results and all(bad == 0 for _, bad in results), results
    e_loader.close()


def test_restarted_sidecar_rejoins_its_pool_and_serves_again(chaos_pool: LocalPool) -> None:
    first = chaos_pool.add(identity="first", peers=[])
    second = chaos_pool.add(identity="second", peers=["first"])
    wait_for("second connected to first", lambda: second.status()["peers"].get("connected", 0) >= 1)
    assert second.terminate(20) == 0
    second.start()
    keys = chunk_keys("after-restart", 8)
    with second.client() as e_second, first.client() as e_first:
        assert store_chunks(e_second, keys, CHUNK) == len(keys)
        wait_for("first seeing the restarted sidecar's chunks", lambda: e_first.lookup(keys).peer >= len(keys))
        assert load_and_verify(e_first, keys, CHUNK) == (len(keys), 0)
    # Served from the restarted sidecar, which keeps them (first keeps no copy once loaded).
    assert second.status()["store"]["chunks"] == len(keys)
    assert first.status()["store"]["chunks"] == 0


def test_sigterm_says_goodbye_on_an_open_data_connection(chaos_pool: LocalPool) -> None:
    server = chaos_pool.add(identity="server", peers=[])
    data_address = server.status()["data_address"]
    probe = probe_handshake(server, chaos_pool.pool_key, chaos_pool.local_hello())
    with RawDataConnection(data_address) as conn:
        conn.authenticate(probe.session)
        server.send(signal.SIGTERM)  # with this connection open and idle
        conn.sock.settimeout(20.0)
        # One CLOSE frame, then an orderly end of stream (not a reset).
        header, payload = conn.read_frame()
        assert header.type is proto.MessageType.CLOSE and payload == b""
        assert conn.sock.recv(1) == b""
    assert server.proc is not None
    _stopped_gracefully(chaos_pool, "server", server.proc.wait(WAIT_BOUND_SECONDS))
