"""A sidecar SIGKILLed again and again on a /dev/shm that holds one store comes back every
time, and the engine client mapping its store re-attaches and hits again, never raising."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_testing.local_pool import LocalPool
from kv_offload_tools.shm_restarts import bounded_tmpfs, kill_and_recover, tmpfs_unavailable
from waiting import wait_for
from host_rights import require

CAPACITY = 16 << 20
# Config, keys, sockets and the sidecar's log beside the store: far less than a second store.
HEAD_ROOM = 2 << 20


@pytest.fixture
def pool() -> Iterator[LocalPool]:
    """One sidecar whose store fills a bounded tmpfs (failing, saying why, where none can be mounted)."""
    require(tmpfs_unavailable())
    with bounded_tmpfs(CAPACITY + HEAD_ROOM) as shm, \
            LocalPool(1, capacity_bytes=CAPACITY, workdir=shm) as pool:
        yield pool


@pytest.fixture
def client(pool: LocalPool) -> Iterator[EngineClient]:
    """An engine client of ``pool``'s sidecar, closed after the test."""
    client = pool.client(0)
    try:
        yield client
    finally:
        client.close()


def test_a_sigkilled_sidecar_comes_back_on_a_bounded_shm_and_the_engine_hits_again(
        pool: LocalPool, client: EngineClient):
    for round_no in range(5):
        r = kill_and_recover(pool, client, round_no)
        assert r.hit_seconds is not None, (round_no, r, pool[0].log_tail())
        assert r.raised == () and r.corrupt == 0, (round_no, r)
        assert r.shm_used_bytes < CAPACITY + HEAD_ROOM  # one store, the old one freed
    assert client.reattaches == 5


def test_a_restart_waits_for_a_copy_still_running_in_the_old_store_then_serves(
        pool: LocalPool, client: EngineClient):
    sc = pool[0]
    keys = chunk_keys("copy-across-a-restart", 2)

    def write(i: int, view: memoryview) -> None:
        if i == 0:  # the copy holds the old mapping while the sidecar is killed and restarted
            sc.kill()
            sc.start(wait=False)
            wait_for("the new sidecar to wait for the old store's pages",
                     lambda: "waiting for vLLM's tier to let go" in sc.log_tail(20))
        view[:] = b"\x02" * len(view)

    assert client.store(keys, write) == 0  # a miss, and the old pages are let go
    sc.wait_ready()

    def stored_again() -> bool:
        return store_chunks(client, keys, pool.chunk_bytes) == len(keys)

    wait_for("the client to re-attach and store again", stored_again)
    assert load_and_verify(client, keys, pool.chunk_bytes) == (len(keys), 0)
