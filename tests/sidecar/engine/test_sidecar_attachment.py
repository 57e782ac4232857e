"""The engine client lets go of a dead sidecar's store at once, without a call, and never
touches a store file through a mapping a copy no longer holds."""

from __future__ import annotations

import mmap
import os
import threading

import pytest
from kv_offload_sidecar.engine.client import EngineClient, RowRegion
from kv_offload_sidecar.engine.region_file import find_region_file
from kv_offload_testing.local_pool import LocalPool
from sidecar_support import new_keys, read_chunks, write_chunks
from waiting import wait_for


def mapped(path: str) -> bool:
    """Whether this process maps ``path`` (also once it is unlinked)."""
    with open("/proc/self/maps") as maps:
        return any(path in line for line in maps)


@pytest.fixture
def pool():
    with LocalPool(1, capacity_bytes=64 * 16384) as p:
        yield p


def test_the_client_unmaps_a_killed_sidecars_store_before_any_call(pool):
    c = pool.client(0)
    path = c.info()["store"]["path"]
    assert mapped(path) and c.attached_now
    pool[0].kill()
    wait_for("the client to let go of the killed sidecar's store", lambda: not mapped(path))
    assert not c.attached_now  # it re-attaches at its next call
    keys = new_keys(2)
    # Calls in the gap are misses, never errors raised into the engine.
    assert c.store(keys, lambda i, v: None) == 0
    assert c.load(keys, lambda i, v: None) == 0
    pool[0].start()

    def reattached() -> bool:
        c.lookup(keys)  # a call is what re-attaches
        return c.attached_now and c.reattaches == 1

    wait_for("the client re-attached to the restarted sidecar", reattached)
    data = write_chunks(c, keys)
    assert read_chunks(c, keys) == [data[k] for k in keys]
    c.close()
    assert not mapped(path)


def test_a_copy_running_when_the_sidecar_dies_keeps_the_mapping_until_it_ends(pool):
    c = pool.client(0)
    path = c.info()["store"]["path"]
    keys = new_keys(2)
    seen: list[bool] = []

    def write(i: int, view: memoryview) -> None:
        if i == 0:
            pool[0].kill()
            wait_for("the client to see its sidecar gone", lambda: not c.attached_now)
        view[:] = b"\x01" * len(view)  # the old mapping is still there to write into
        seen.append(mapped(path))

    assert c.store(keys, write) == 0  # the commit goes nowhere: a miss
    assert seen == [True, True]
    assert not mapped(path)  # let go once the copy ended
    c.close()


def test_a_closed_client_leaves_no_thread_or_mapping_behind(pool):
    c = pool.client(0)
    path, watch = c.info()["store"]["path"], f"kv-offload store watch {c.instance}"
    assert watch in [t.name for t in threading.enumerate()]
    c.close()
    assert not mapped(path)
    assert watch not in [t.name for t in threading.enumerate()]
    other = pool.client(0)  # the sidecar serves on
    keys = new_keys(1)
    data = write_chunks(other, keys)
    assert read_chunks(other, keys) == [data[k] for k in keys]
    other.close()


def test_a_client_sharing_its_rows_lets_go_on_the_regions_connection_and_hands_them_over_again(pool):
    slot, rows = pool.chunk_bytes, 4
    fd = os.memfd_create("kv-offload-test-rows", os.MFD_CLOEXEC)
    os.ftruncate(fd, rows * slot)
    region_map = mmap.mmap(fd, rows * slot)
    os.close(fd)
    found, reason = find_region_file(memoryview(region_map))
    assert found is not None, reason
    c = EngineClient.connect("127.0.0.1", pool[0].port, region=RowRegion(found, slot, rows, slot))
    assert c.region_attached, c.region_reason
    path = c.info()["store"]["path"]
    pool.restart(0, kill=True)
    wait_for("the client to let go of the killed sidecar's store", lambda: not mapped(path + " (deleted)")
             and not c.attached_now)
    keys = new_keys(2)
    region_map[:2 * slot] = os.urandom(2 * slot)

    def stored() -> bool:
        return c.store_rows(keys, [0, 1]) == 2  # a miss until it re-attached

    wait_for("the client to re-attach and hand its rows over again", stored)
    assert c.region_attached and c.reattaches == 1
    assert c.load_rows(keys, [2, 3]) == 2
    assert region_map[2 * slot:4 * slot] == region_map[:2 * slot]
    c.close()
    region_map.close()
