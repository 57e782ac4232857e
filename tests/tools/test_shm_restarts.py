"""A sidecar SIGKILLed again and again on a /dev/shm that holds one store comes back every
time, and the engine client mapping its store re-attaches and hits again, never raising."""

from __future__ import annotations

import pytest
from kv_offload_tools.local_pool import LocalPool
from kv_offload_tools.shm_restarts import bounded_tmpfs, kill_and_recover, tmpfs_unavailable

CAPACITY = 16 << 20
# Config, keys, sockets and the sidecar's log beside the store: far less than a second store.
HEAD_ROOM = 2 << 20


def test_a_sigkilled_sidecar_comes_back_on_a_bounded_shm_and_the_engine_hits_again():
    reason = tmpfs_unavailable()
    if reason:
        pytest.skip(reason)
    with bounded_tmpfs(CAPACITY + HEAD_ROOM) as shm, \
            LocalPool(1, capacity_bytes=CAPACITY, workdir=shm) as pool:
        client = pool.client(0)
        try:
            for round_no in range(5):
                r = kill_and_recover(pool, client, round_no)
                assert r.hit_seconds is not None, (round_no, r, pool[0].log_tail())
                assert r.raised == () and r.corrupt == 0, (round_no, r)
                assert r.shm_used_bytes < CAPACITY + HEAD_ROOM  # one store, the old one freed
            assert client.reattaches == 5
        finally:
            client.close()
