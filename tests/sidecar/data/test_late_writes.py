"""No byte of a TCP or TLS fetch lands in a row of vLLM's after its load job's deadline, whatever
the fetcher's event loop does (``data.write_gates``): the holder is a real process, stopped
(SIGSTOP) mid-chunk and resumed (SIGCONT) while the fetcher's loop is blocked past the deadline.

The fetcher is this test process; a blocked loop is this test blocking it (``wait_for`` sleeps
on the loop's thread), as CPU throttling or a long pause would. Bytes written after the deadline
are counted twice: the row is filled with a sentinel once the deadline passed and must keep it,
and the gates count the bytes of any write that ended past a deadline (``late_writes``)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import threading
import time
from collections.abc import Callable

import pytest
from kv_offload_sidecar.data import ReceiveStopped, connect
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.data.tls import client_context
from kv_offload_sidecar.data.write_gates import late_writes
from kv_offload_sidecar.peers.row_landings import LandingState, LandingStore, RowLandings
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_tools.certs import CertFiles, pool_certificates
from peer_processes import PeerProcess, run_ucx_client
from transport_peers import SESSION_ID, SESSION_KEY, chunk_bytes_in, content_of, key_of
from waiting import wait_for, wait_for_async

GUARD = 0xEE
SENTINEL = 0x5A
# A chunk received on the connection's thread, long enough that a SIGSTOP lands mid-chunk.
BIG_CHUNK = 64 << 20
# Chunks received on the event loop (under OFF_LOOP_BYTES), several reads each.
SMALL_CHUNK = 768 << 10
# Seconds from the offer to the row's deadline: enough for the first bytes to arrive.
ROW_SECONDS = 2.0


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    return pool_certificates(tmp_path_factory.mktemp("pool"), ["server", "client"])


@pytest.fixture(params=["tcp", "tls"])
def plane(request: pytest.FixtureRequest, pool: dict[str, CertFiles],
          start_peer: Callable[..., PeerProcess]) -> Callable[..., tuple[PeerProcess, ssl.SSLContext | None]]:
    """Start a holder of the plane under test; returns it and the client's TLS context."""

    def start(**kw: object) -> tuple[PeerProcess, ssl.SSLContext | None]:
        if request.param == "tcp":
            return start_peer("tcp", **kw), None
        files = pool["client"]
        return (start_peer("tcp", certs=pool["server"], **kw),
                client_context(files.cert_file, files.key_file, files.ca_file))

    return start


def _row(nbytes: int) -> memoryview:
    return memoryview(bytearray([GUARD]) * nbytes)


def _stop_when_filling(row: memoryview, pid: int) -> threading.Thread:
    """SIGSTOP ``pid`` as soon as ``row``'s first bytes landed (a spinning thread)."""
    def spin() -> None:
        guard = bytes([GUARD]) * 4096
        while row[:4096] == guard:
            pass
        os.kill(pid, signal.SIGSTOP)

    thread = threading.Thread(target=spin, name="stop-holder", daemon=True)
    thread.start()
    return thread


async def test_a_holder_resumed_past_the_row_deadline_writes_nothing_into_the_row_while_the_loop_is_blocked(
        plane: Callable[..., tuple[PeerProcess, ssl.SSLContext | None]],
        make_store: Callable[..., ChunkStore]) -> None:
    peer, ctx = plane(chunks=2, chunk_bytes=BIG_CHUNK)
    store = make_store(slots=3, chunk_bytes=BIG_CHUNK)
    landings = RowLandings(on_landed=lambda: None)
    row = _row(BIG_CHUNK)
    before = late_writes()
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=10, ssl=ctx)
    deadline = time.monotonic() + ROW_SECONDS
    offer = landings.offer(key_of(0), row, deadline)
    assert offer is not None
    stopper = _stop_when_filling(row, peer.pid)
    fetch = asyncio.create_task(client.fetch([key_of(0)], LandingStore(store, landings), timeout=60))
    try:
        await wait_for_async("the holder stopped mid-chunk", lambda: not stopper.is_alive())
        assert offer.state is LandingState.RECEIVING
        # From here on the loop is blocked (as by CPU throttling or a pause) until the end.
        wait_for("the row's deadline", lambda: time.monotonic() > deadline)
        assert bytes(row[-4096:]) == bytes([GUARD]) * 4096, "the chunk was whole before the SIGSTOP"
        row[:] = bytes([SENTINEL]) * BIG_CHUNK
        os.kill(peer.pid, signal.SIGCONT)
        # The connection's thread refuses the rest (new code) or writes it into the row (a bug).
        wait_for("the rest of the chunk refused or written",
                 lambda: late_writes().refused_past_deadline > before.refused_past_deadline
                 or row[-1] != SENTINEL)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    with pytest.raises(ReceiveStopped):
        await fetch
    assert bytes(row) == bytes([SENTINEL]) * BIG_CHUNK, "bytes landed in the row after its deadline"
    assert late_writes().bytes_after_deadline == before.bytes_after_deadline
    assert not store.contains(key_of(0))
    assert store.used_bytes == 0  # the slot went back once the thread had stopped
    landings.release([offer])
    # The slot is reused: a chunk committed there later verifies, and no late byte lands in it.
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=10, ssl=ctx)
    try:
        assert await client.fetch([key_of(1), key_of(0)], store, timeout=60) == 2
    finally:
        await client.close()
    assert chunk_bytes_in(store, key_of(1)) == content_of(1, BIG_CHUNK)
    assert chunk_bytes_in(store, key_of(0)) == content_of(0, BIG_CHUNK)


async def test_a_loop_blocked_past_the_row_deadline_writes_nothing_into_rows_once_it_resumes(
        plane: Callable[..., tuple[PeerProcess, ssl.SSLContext | None]],
        make_store: Callable[..., ChunkStore]) -> None:
    assert SMALL_CHUNK < OFF_LOOP_BYTES  # these chunks are received by the event loop itself
    chunks = 24
    peer, ctx = plane(chunks=chunks, chunk_bytes=SMALL_CHUNK)
    store = make_store(slots=chunks + 1, chunk_bytes=SMALL_CHUNK)
    landings = RowLandings(on_landed=lambda: None)
    keys = [key_of(i) for i in range(chunks)]
    rows = [_row(SMALL_CHUNK) for _ in keys]
    before = late_writes()
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=10, ssl=ctx)
    deadline = time.monotonic() + ROW_SECONDS
    offers = [landings.offer(k, r, deadline) for k, r in zip(keys, rows)]
    fetch = asyncio.create_task(client.fetch(keys, LandingStore(store, landings), timeout=60))
    await wait_for_async("the first row filling", lambda: rows[0][:4096] != bytes([GUARD]) * 4096,
                         interval=0)
    # The loop is blocked past the deadline while the holder keeps sending.
    wait_for("the rows' deadline", lambda: time.monotonic() > deadline)
    late = [i for i, o in enumerate(offers) if o is not None and not o.landed]
    assert late, "every chunk landed before the loop was blocked"
    for i in late:
        rows[i][:] = bytes([SENTINEL]) * SMALL_CHUNK
    # A chunk cut off in its row ends the connection (ReceiveStopped); those whose rows were
    # past their deadline at their first byte went to their slots, the fetch's deadline being far.
    (outcome,) = await asyncio.gather(fetch, return_exceptions=True)
    assert isinstance(outcome, (int, ReceiveStopped)), outcome
    for i in late:
        assert bytes(rows[i]) == bytes([SENTINEL]) * SMALL_CHUNK, f"row {i} was written after its deadline"
    assert late_writes().bytes_after_deadline == before.bytes_after_deadline
    for i, key in enumerate(keys):  # what was stored verifies
        if store.contains(key):
            assert chunk_bytes_in(store, key) == content_of(i, SMALL_CHUNK)
    landings.release(offers)
    await client.close()


def test_a_ucx_slot_a_stopped_holder_may_still_write_is_not_reused_until_its_write_is_over(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    # put_zcopy over shared memory: the holder writes into the fetcher's slot itself, resumed or not.
    peer = start_peer("ucx", tls="sm,self", chunks=3, chunk_bytes=BIG_CHUNK)
    out = run_ucx_client(peer, "late_holder", tls="sm,self", shm_dir=shm_dir, chunks=3,
                         chunk_bytes=BIG_CHUNK, timeout=120)
    assert out["stopped_mid_chunk"] and out["partial"], out
    assert "deadline" in out["error"], out
    assert out["held_by_failure"] == 1, out  # quarantined while the holder may write
    assert not out["overwritten_while_free"], out
    assert out["held_at_end"] == 0 and out["quarantined"] == 0, out  # freed once the write was over
    assert out["refetched"] == 3 and out["visible_intact"], out  # the reused slot verifies
