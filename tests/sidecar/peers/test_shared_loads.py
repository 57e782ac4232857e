"""One fetch per pod for a key: two engines (or data-parallel ranks) of one pod loading the
same keys at once share one transfer from the holder, and each job gets its rows, byte for
byte, though the chunks landed in the rows one of them offered."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest
from kv_offload_sidecar.engine.client import EngineClient, RowRegion
from kv_offload_sidecar.engine.region_file import find_region_file
from kv_offload_tools.local_pool import LocalPool, example_config
from waiting import wait_for

CHUNK = 1 << 20  # large enough that both loads ask while the chunks are still on the wire
N = 16
STRIDE = CHUNK + mmap.PAGESIZE


class Region:
    """A memfd-backed primary region of N rows, as vLLM's SharedOffloadRegion maps /dev/shm."""

    def __init__(self, name: str) -> None:
        fd = os.memfd_create(f"kv-offload-test-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, N * STRIDE)
        self.map = mmap.mmap(fd, N * STRIDE)
        os.close(fd)
        self.rows = np.frombuffer(self.map, dtype=np.uint8).reshape(N, STRIDE)
        self.rows[:] = 0xEE
        found, reason = find_region_file(memoryview(self.map))
        assert found is not None, reason
        self.spec = RowRegion(found, STRIDE, N, CHUNK)

    def fill(self, row: int) -> bytes:
        data = os.urandom(CHUNK)
        self.rows[row, :CHUNK] = np.frombuffer(data, dtype=np.uint8)
        return data

    def chunk(self, row: int) -> bytes:
        return self.rows[row, :CHUNK].tobytes()


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


def test_two_loads_of_the_same_keys_share_one_fetch_and_both_get_their_rows(pair):
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
            loaded[i] = ranks[i].load_rows(keys, list(range(N)), timeout=20.0)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert loaded == [N, N]
        for region in regions:
            assert [region.chunk(r) for r in range(N)] == data
            assert (region.rows[:, CHUNK:] == 0xEE).all()  # nothing past a row's chunk
        # One transfer: the holder sent each chunk once, and the second load joined the first's.
        assert pair[0].metric("kv_offload_peer_bytes_total", direction="sent") - sent == N * CHUNK
        assert pair[1].metric("kv_offload_fetches_joined_total") - joined == 1
        # The copies the second load needed are let go once both loaded (the holder keeps them).
        wait_for("the fetched copies let go", lambda: pair[1].held(keys)[0] == 0)
    finally:
        holder.close()
        for c in ranks:
            c.close()
