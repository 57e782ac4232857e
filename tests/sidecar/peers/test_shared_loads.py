"""One fetch per pod for a key: two engines (or data-parallel ranks) of one pod loading the
same keys at once share one transfer from the holder, and each job gets its rows, byte for
byte, though the chunks landed in the rows one of them offered."""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import threading
from collections.abc import Sequence

import pytest
from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.row_landings import RowLandings
from kv_offload_sidecar.peers.shared_loads import SharedLoads
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_testing.local_pool import LocalPool, example_config
from prometheus_client import CollectorRegistry
from primary_rows import PrimaryRows
from waiting import wait_for, wait_for_async

CHUNK = 1 << 20  # large enough that both loads ask while the chunks are still on the wire
N = 16
STRIDE = CHUNK + mmap.PAGESIZE


# A primary region of N rows of STRIDE bytes, CHUNK-byte chunks.
Region = functools.partial(PrimaryRows, rows=N, stride=STRIDE, chunk_bytes=CHUNK)


@pytest.fixture(scope="module")
def pair():
    """A holder (0) and a pod whose engines load from it (1, dropping fetched copies once
    loaded: the default, under which load jobs offer their rows)."""
    config = example_config(worker_kv_bytes_per_block=CHUNK // 4)
    with LocalPool(2, config=config, capacity_bytes=3 * N * CHUNK, fetch_deadline_seconds=20.0) as p:
        p.wait_connected()
        yield p


def _client(pool, i, region):
    c = EngineClient.connect("127.0.0.1", pool[i].port, region=region.spec)
    assert c.region_attached, c.region_reason
    return c


@pytest.mark.parametrize("looked_up", [False, True], ids=["loads", "lookups-then-loads"])
def test_two_loads_of_the_same_keys_share_one_fetch_and_both_get_their_rows(pair, looked_up):
    holder_region, regions = Region("holder"), [Region("rank-0"), Region("rank-1")]
    holder = _client(pair, 0, holder_region)
    ranks = [_client(pair, 1, r) for r in regions]
    try:
        keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(N)]
        data = [holder_region.fill(r) for r in range(N)]
        assert holder.store_rows(keys, list(range(N))) == N
        wait_for("the holder's chunks visible to the loading pod", lambda: pair[1].hits(keys) >= N)
        sent = pair[0].metric("kv_offload_peer_bytes_total", direction="sent")
        joined = pair[1].metric("kv_offload_fetches_joined_total")
        start, loaded = threading.Barrier(2), [-1, -1]

        def load(i: int) -> None:
            start.wait()
            if looked_up:  # as vLLM does: the lookups start the fetch, the loads wait for it
                hit = ranks[i].lookup(keys, timeout=20.0)
                assert hit.local + hit.peer == N
            loaded[i] = ranks[i].load_rows(keys, list(range(N)), timeout=20.0)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert loaded == [N, N], pair[1].log_tail(30)
        for region in regions:
            assert [region.chunk(r) for r in range(N)] == data
            assert (region.rows[:, CHUNK:] == 0xEE).all()  # nothing past a row's chunk
        # One transfer: the holder sent each chunk once (the second lookup joins the first's
        # fetch; without lookups, the second load joins the first's).
        assert pair[0].metric("kv_offload_peer_bytes_total", direction="sent") - sent == N * CHUNK
        if not looked_up:
            assert pair[1].metric("kv_offload_fetches_joined_total") - joined == 1
        # The copies the second load needed are let go once both loaded (the holder keeps them).
        wait_for("the fetched copies let go", lambda: pair[1].held(keys)[0] == 0)
    finally:
        holder.close()
        for c in ranks:
            c.close()


# ---- SharedLoads on one loop, with a stand-in for the peer reads ----------------------------

SMALL = 4096


class Reads:
    """PeerReads as SharedLoads sees it: each fetch waits until the test ends it (``ends``)."""

    def __init__(self) -> None:
        self.started: list[list[bytes]] = []
        self.ends: list[asyncio.Event] = []
        self.cancelled = 0
        self.fetched: set[bytes] = set()

    async def load(self, keys: Sequence[bytes], local: int, timeout: float) -> None:
        self.started.append(list(keys[local:]))
        self.ends.append(end := asyncio.Event())
        try:
            await end.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def lookup(self, keys: Sequence[bytes], local: int, timeout: float, *, fetch: bool) -> int:
        self.started.append(list(keys[local:]))
        self.ends.append(end := asyncio.Event())
        await end.wait()
        return len(keys) - local

    def take_fetched(self, keys: Sequence[bytes]) -> list[bytes]:
        out = [k for k in keys if k in self.fetched]
        self.fetched.difference_update(out)
        return out

    def take_unloaded(self, older_than: float) -> list[bytes]:
        return []


class Loads:
    def __init__(self, shm_dir: str) -> None:
        self.metrics = SidecarMetrics(CollectorRegistry())
        self.store = ChunkStore(SMALL, 8 * slot_stride_for(SMALL), directory=shm_dir,
                                name=f"shared-loads-{os.getpid()}", metrics=self.metrics,
                                on_change=lambda key, present: self.wake())
        self.reads = Reads()
        self.arrived = asyncio.Event()
        self.let_go: list[bytes] = []
        self.loads = SharedLoads(store=lambda: self.store, reads=self.reads,
                                 landings=RowLandings(on_landed=self.wake), metrics=self.metrics,
                                 arrivals=lambda: self.arrived,
                                 let_go=lambda _store, keys: self.let_go.extend(keys),
                                 unloaded_after=lambda: 60.0)

    def wake(self) -> None:
        arrived, self.arrived = self.arrived, asyncio.Event()
        arrived.set()

    def land(self, key: bytes) -> None:
        res = self.store.begin_write(key)
        assert res is not None
        res.view[:] = os.urandom(SMALL)
        assert res.commit()
        self.reads.fetched.add(key)

    def load(self, keys: list[bytes]) -> asyncio.Task[int]:
        pins: list = []
        task = asyncio.ensure_future(self.loads.load_each(keys, 10.0, pins.append))
        task.add_done_callback(lambda _t: [p.release() for p in pins if p is not None])
        return task

    @property
    def joined(self) -> float:
        return self.metrics.fetches_joined._value.get()


@pytest.fixture
def loads(shm_dir: str):
    out = Loads(shm_dir)
    yield out
    out.store.close()


def _small_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]


async def test_a_load_joins_the_fetch_another_load_runs_and_it_outlives_the_one_that_started_it(
        loads: Loads) -> None:
    keys = _small_keys(2)
    first = loads.load(keys)
    await wait_for_async("the first load's fetch", lambda: loads.reads.started)
    second = loads.load(keys)
    await wait_for_async("the second load joined it", lambda: loads.joined == 1)
    first.cancel()  # its job ended: the fetch goes on for the second
    await asyncio.gather(first, return_exceptions=True)
    assert loads.reads.cancelled == 0 and loads.loads.in_flight == 1
    for key in keys:
        loads.land(key)
    assert await second == 2
    # The last load waiting on it left: the fetch is cancelled, and one fetch was started in all.
    assert loads.reads.cancelled == 1 and len(loads.reads.started) == 1 and loads.loads.in_flight == 0


async def test_a_fetched_copy_another_load_waits_for_is_let_go_only_once_both_loaded(
        loads: Loads) -> None:
    keys = _small_keys(2)
    first, second = loads.load(keys), loads.load(keys)
    await wait_for_async("both loads waiting on one fetch", lambda: loads.joined == 1)
    loads.land(keys[0])
    loads.land(keys[1])
    assert await asyncio.gather(first, second) == [2, 2]
    assert sorted(loads.let_go) == sorted(keys)  # each once, by whichever load ended last


async def test_a_load_left_short_by_the_fetch_it_joined_fetches_the_rest_itself(loads: Loads) -> None:
    keys = _small_keys(3)
    first = loads.load(keys[:1])
    await wait_for_async("the first load's fetch", lambda: loads.reads.started)
    second = loads.load(keys)
    await wait_for_async("the second load joined it", lambda: loads.joined == 1)
    loads.land(keys[0])
    assert await first == 1
    loads.reads.ends[0].set()  # the joined fetch ends, having brought the first key only
    await wait_for_async("the second load's own fetch", lambda: len(loads.reads.started) == 2)
    assert loads.reads.started[1] == keys[1:]
    loads.land(keys[1])
    loads.land(keys[2])
    assert await second == 3


async def test_loads_whose_shared_fetch_was_cut_short_fetch_the_rest_once_together(loads: Loads) -> None:
    keys = _small_keys(2)
    first = loads.load(keys)
    await wait_for_async("the first load's fetch", lambda: loads.reads.started)
    second = loads.load(keys)
    await wait_for_async("the second load joined it", lambda: loads.joined == 1)
    loads.reads.ends[0].set()  # cut short (a job's row withdrawn mid-chunk ends the connection)
    await wait_for_async("one fetch of the rest, joined", lambda: loads.joined == 2)
    assert len(loads.reads.started) == 2 and loads.reads.started[1] == keys
    for key in keys:
        loads.land(key)
    assert await asyncio.gather(first, second) == [2, 2]
    loads.reads.ends[1].set()
    assert loads.reads.cancelled == 1  # the retry, left by both once they had their keys


async def test_a_lookup_of_keys_another_lookup_asks_about_waits_for_its_answer_and_counts_again(
        loads: Loads) -> None:
    keys = _small_keys(2)
    first = asyncio.ensure_future(loads.loads.lookup(keys, 0, 10.0, fetch=True))
    await wait_for_async("the first lookup asking", lambda: loads.reads.started)
    others = [asyncio.ensure_future(loads.loads.lookup(keys, 0, 10.0, fetch=True)) for _ in range(2)]
    loads.land(keys[0])  # the first one's fetch brought the first key meanwhile
    loads.reads.ends[0].set()
    assert await first == (0, 2)
    await wait_for_async("the others asking", lambda: len(loads.reads.started) == 3)
    # They asked only once it had answered: from the local prefix counted then.
    assert loads.reads.started[1:] == [keys[1:], keys[1:]]
    for end in loads.reads.ends[1:]:
        end.set()
    assert await asyncio.gather(*others) == [(1, 1), (1, 1)]
