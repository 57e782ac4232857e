"""No byte of a TCP or TLS fetch lands in a row of vLLM's after its load job's deadline, whatever
the fetcher's event loop does (``data.write_gates``): the holder is a real process, stopped
(SIGSTOP) mid-chunk and resumed (SIGCONT) while the fetcher's loop is blocked past the deadline.
No byte of a UCX or NIXL fetch lands in a store slot once it is free again: the fetcher is a
process of its own (``kv_offload_tools.chaos.late_slot_writer``; UCX reads its environment once
per process), the UCX holder stopped mid-write, the NIXL fetcher's loop blocked past the deadline
so that its READ is posted late (the gate must refuse it).

The fetcher is this test process; a blocked loop is this test blocking it (the cases of
``kv_offload_tools.chaos.late_writer``, which the chaos bench's late-writer row runs too, sleep
on the loop's thread), as CPU throttling or a long pause would. Bytes written after the deadline
are counted twice: the row is filled with a sentinel once the deadline passed and must keep it,
and the gates count the bytes of any write that ended past a deadline (``late_writes``)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable

import pytest
from kv_offload_sidecar.data import connect
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.data.tls import client_context
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_testing.certs import CertFiles, pool_certificates
from kv_offload_tools.chaos.late_writer import (
    BIG_CHUNK,
    SMALL_CHUNK,
    SMALL_CHUNKS,
    ended_as_expected,
    holder_stopped_past_deadline,
    loop_blocked_past_deadline,
)
from peer_processes import PeerProcess, run_late_slot_writer
from transport_peers import SESSION_ID, SESSION_KEY, content_of, key_of

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


def _expected(keys: list[bytes], nbytes: int) -> Callable[[bytes], bytes]:
    return lambda key: content_of(keys.index(key), nbytes)


async def test_a_holder_resumed_past_the_row_deadline_writes_nothing_into_the_row_while_the_loop_is_blocked(
        plane: Callable[..., tuple[PeerProcess, ssl.SSLContext | None]],
        make_store: Callable[..., ChunkStore]) -> None:
    peer, ctx = plane(chunks=2, chunk_bytes=BIG_CHUNK)
    keys = [key_of(0), key_of(1)]
    run = await holder_stopped_past_deadline(
        lambda: connect(peer.address, SESSION_ID, SESSION_KEY, timeout=10, ssl=ctx),
        make_store(slots=3, chunk_bytes=BIG_CHUNK), keys, _expected(keys, BIG_CHUNK), peer.pid, ROW_SECONDS)
    assert run.stopped_mid_chunk, run
    assert run.refused > 0, run  # the connection's thread refused the rest of the chunk
    assert run.bytes_after_deadline == 0, "bytes landed in the row after its deadline"
    assert isinstance(run.outcome, Exception) and ended_as_expected(run.outcome), run.outcome
    assert not run.stored_cut_chunk
    assert run.slots_in_use == 0  # the slot went back once the thread had stopped
    assert run.refetched == 2 and run.verified == 2, run  # the reused slot verifies


async def test_a_loop_blocked_past_the_row_deadline_writes_nothing_into_rows_once_it_resumes(
        plane: Callable[..., tuple[PeerProcess, ssl.SSLContext | None]],
        make_store: Callable[..., ChunkStore]) -> None:
    assert SMALL_CHUNK < OFF_LOOP_BYTES  # these chunks are received by the event loop itself
    peer, ctx = plane(chunks=SMALL_CHUNKS, chunk_bytes=SMALL_CHUNK)
    keys = [key_of(i) for i in range(SMALL_CHUNKS)]
    run = await loop_blocked_past_deadline(
        lambda: connect(peer.address, SESSION_ID, SESSION_KEY, timeout=10, ssl=ctx),
        make_store(slots=SMALL_CHUNKS + 1, chunk_bytes=SMALL_CHUNK), keys, _expected(keys, SMALL_CHUNK),
        ROW_SECONDS)
    assert run.late_rows, "every chunk landed before the loop was blocked"
    assert ended_as_expected(run.outcome), run.outcome
    assert run.bytes_after_deadline == 0, "rows were written after their deadline"
    assert run.verified == run.stored, run  # what was stored verifies


def test_a_ucx_slot_a_stopped_holder_may_still_write_is_not_reused_until_its_write_is_over(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    # put_zcopy over shared memory: the holder writes into the fetcher's slot itself, resumed or not.
    peer = start_peer("ucx", tls="sm,self", chunks=3, chunk_bytes=BIG_CHUNK)
    (run,) = run_late_slot_writer(peer, "ucx", tls="sm,self", shm_dir=shm_dir, chunks=3,
                                  chunk_bytes=BIG_CHUNK)
    assert run["in_flight"], run
    assert "deadline" in run["error"], run
    assert run["held_by_failure"] == 1, run  # quarantined while the holder may write
    assert run["bytes_after_deadline"] == 0, run  # nothing changed the slot once it was free
    assert run["held_at_end"] == 0, run  # freed once the write was over
    assert run["refetched"] == 3 and run["verified"] == 3, run  # the reused slot verifies


def test_a_nixl_read_posted_after_the_deadline_by_a_blocked_loop_is_refused_and_writes_nothing(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    # The fetcher's loop is blocked past the deadline as the holder's CHUNK_AT comes in: the read
    # job reaches the lane late, whose gate check must refuse the READ.
    peer = start_peer("nixl", chunks=2, chunk_bytes=BIG_CHUNK)
    (run,) = run_late_slot_writer(peer, "nixl", tls=os.environ["UCX_TLS"], shm_dir=shm_dir, chunks=2,
                                  chunk_bytes=BIG_CHUNK, cases="loop_blocked")
    assert run["in_flight"], run
    assert run["bytes_after_deadline"] == 0, run  # the slot kept its sentinel
    assert run["refused"] == 1, run  # the lane refused the READ (late_writes counted it)
    assert run["error"] and "deadline" in run["error"], run
    assert run["held_at_end"] == 0, run
    assert run["refetched"] == 2 and run["verified"] == 2, run  # the reused slot verifies


def _nixl_over_tcp_holder_stopped(start_peer: Callable[..., PeerProcess], shm_dir: str) -> tuple[PeerProcess, dict]:
    # Over UCX's tcp transport the holder serves the fetcher's READ (emulated), so a SIGSTOP holds
    # the READ mid-chunk past the fetch's deadline (over cma it would copy from a stopped holder).
    peer = start_peer("nixl", tls="tcp", chunks=2, chunk_bytes=BIG_CHUNK)
    (run,) = run_late_slot_writer(peer, "nixl", tls="tcp", shm_dir=shm_dir, chunks=2,
                                  chunk_bytes=BIG_CHUNK, cases="holder_stopped")
    return peer, run


def test_a_nixl_slot_a_stopped_holder_still_serves_is_not_reused_until_the_read_is_over(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    _, run = _nixl_over_tcp_holder_stopped(start_peer, shm_dir)
    assert run["in_flight"], run
    assert "deadline" in run["error"], run
    assert run["held_by_failure"] == 1, run  # reserved while the READ may still write
    assert run["bytes_after_deadline"] == 0, run  # nothing changed the slot once it was free
    assert run["held_at_end"] == 0, run  # freed once the READ was over


def test_a_nixl_holder_whose_fetcher_gave_up_mid_read_over_tcp_serves_on(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer, run = _nixl_over_tcp_holder_stopped(start_peer, shm_dir)
    assert peer.alive() and run["refetch_error"] is None, run
    assert run["refetched"] == 2 and run["verified"] == 2, run  # the reused slot verifies
