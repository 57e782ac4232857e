"""``fetch.commit_received`` blames the holder (IntegrityError, an integrity failure counted)
only for bytes that failed their checksum; a commit that fails for a reason of this side's (the
store closed, the reservation or the row's load job ended first) is a ``CommitRefused``, a
``ReceiveStopped``, which ``peers.peer_reads`` does not hold against the peer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from kv_offload_sidecar.data.base import CommitRefused, IntegrityError, ReceiveStopped
from kv_offload_sidecar.data.fetch import PendingChunk, commit_outcome, commit_received, run_fetch
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.row_landings import LandingStore, RowLandings
from kv_offload_sidecar.store.checksum import chunk_checksum
from kv_offload_sidecar.store.chunk_store import ChunkStore
from prometheus_client import CollectorRegistry

KEY = b"k" * 36
CHUNK = 64 << 10


def _received(store: ChunkStore | LandingStore, fill: int = 7) -> tuple[PendingChunk, int]:
    """A chunk reserved and whole in its slot, and the checksum its holder sent."""
    res = store.begin_write(KEY)
    assert res is not None
    data = bytes([fill]) * CHUNK
    view = res.receive_view(lambda: None)
    view[:] = data
    done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    return PendingChunk(KEY, res, done, CHUNK), chunk_checksum(data)


def _failure(p: PendingChunk) -> BaseException:
    assert p.done.done()
    exc = p.done.exception()
    assert exc is not None
    return exc


async def test_a_chunk_that_fails_its_checksum_is_the_peers_fault(
        make_store: Callable[..., ChunkStore]) -> None:
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(chunk_bytes=CHUNK, metrics=metrics)
    p, checksum = _received(store)
    commit_received(p, checksum ^ 1, metrics)
    assert isinstance(_failure(p), IntegrityError)
    assert metrics.integrity_failures._value.get() == 1


@pytest.mark.parametrize("reason", ["reservation_ended", "store_closed"])
async def test_a_commit_failing_for_a_local_reason_is_not_blamed_on_the_peer(
        make_store: Callable[..., ChunkStore], reason: str) -> None:
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(chunk_bytes=CHUNK, metrics=metrics)
    p, checksum = _received(store)
    if reason == "reservation_ended":
        p.reservation.abort()
    else:
        store.close()
    commit_received(p, checksum, metrics)
    exc = _failure(p)
    assert isinstance(exc, CommitRefused) and isinstance(exc, ReceiveStopped)
    assert not isinstance(exc, IntegrityError), exc
    assert "not the peer's" in str(exc)
    assert metrics.integrity_failures._value.get() == 0


async def test_a_chunk_whose_rows_job_ended_before_its_commit_is_not_blamed_on_the_peer(
        make_store: Callable[..., ChunkStore]) -> None:
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(chunk_bytes=CHUNK, metrics=metrics)
    landings = RowLandings(on_landed=lambda: None)
    row = memoryview(bytearray(CHUNK))
    offer = landings.offer(KEY, row)
    p, checksum = _received(LandingStore(store, landings, metrics))
    assert bytes(row) == bytes([7]) * CHUNK  # it landed in the row
    landings.release([offer])  # the job ended before the commit
    commit_received(p, checksum, metrics)
    assert isinstance(_failure(p), CommitRefused)
    assert metrics.integrity_failures._value.get() == 0
    assert store.used_bytes == 0


async def test_a_fetch_counts_the_chunks_it_landed_though_a_load_let_go_of_them_before_it_heard(
        make_store: Callable[..., ChunkStore]) -> None:
    """A lane's thread commits a chunk (visible at once) and only then tells the fetch's task.
    In between, a load may take the chunks and let go of them (the pool keeps fetched chunks at
    their holders): the fetch still counts them, since ``peer_reads`` credits the holder's
    claim, times the transfer and starts the next holder's run by that count."""
    store = make_store(chunk_bytes=CHUNK)
    keys = [bytes([i]) * 36 for i in range(3)]
    loop = asyncio.get_running_loop()

    async def land_on_a_thread(batch: list[tuple[int, PendingChunk]]) -> None:
        for _, p in batch:
            data = bytes([len(p.key)]) * CHUNK
            p.reservation.receive_view(lambda: None)[:] = data
            assert commit_outcome(p, chunk_checksum(data), None) is None  # visible now
            store.drop_when_released([p.key])  # a load took it and let go of it
            loop.call_soon(p.done.set_result, True)  # the thread tells the loop afterwards

    got = await run_fetch(keys, store, 5.0, window=4, send_requests=land_on_a_thread,
                          fail=lambda exc: None, metrics=None)
    assert got == len(keys)
    assert not any(store.contains(k) for k in keys)
