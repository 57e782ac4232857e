"""No byte of a TCP or TLS fetch lands in a row of vLLM's after its load job's deadline, whatever
the fetcher's event loop does (``data.write_gates``): the holder is a real process, stopped
(SIGSTOP) mid-chunk and resumed (SIGCONT) while the fetcher's loop is blocked past the deadline.

The fetcher is this test process; a blocked loop is this test blocking it (the cases of
``kv_offload_tools.chaos.late_writer``, which the chaos bench's late-writer row runs too, sleep
on the loop's thread), as CPU throttling or a long pause would. Bytes written after the deadline
are counted twice: the row is filled with a sentinel once the deadline passed and must keep it,
and the gates count the bytes of any write that ended past a deadline (``late_writes``)."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import pytest
from kv_offload_sidecar.data import connect
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.data.tls import client_context
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_tools.certs import CertFiles, pool_certificates
from kv_offload_tools.chaos.late_writer import (
    BIG_CHUNK,
    SMALL_CHUNK,
    SMALL_CHUNKS,
    ended_as_expected,
    holder_stopped_past_deadline,
    loop_blocked_past_deadline,
)
from peer_processes import PeerProcess, run_ucx_client
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
    out = run_ucx_client(peer, "late_holder", tls="sm,self", shm_dir=shm_dir, chunks=3,
                         chunk_bytes=BIG_CHUNK, timeout=120)
    assert out["stopped_mid_chunk"] and out["partial"], out
    assert "deadline" in out["error"], out
    assert out["held_by_failure"] == 1, out  # quarantined while the holder may write
    assert not out["overwritten_while_free"], out
    assert out["held_at_end"] == 0 and out["quarantined"] == 0, out  # freed once the write was over
    assert out["refetched"] == 3 and out["visible_intact"], out  # the reused slot verifies
