"""NetnsPool: real sidecars, one per pod namespace, find each other by the pool name and share
chunks through the router."""

from __future__ import annotations

from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
from kv_offload_tools.netns.network import namespaces
from kv_offload_tools.netns.pool import NetnsPool


def test_three_pods_found_by_the_pool_name_share_chunks_across_the_router(netns_pool: NetnsPool):
    pool = netns_pool
    pod_addresses = {f"{pool.pod(i).ip}:{pool.base_port}" for i in range(3)}
    for sc in pool.sidecars:
        connected = {p["address"] for p in sc.peers() if p["state"] == "connected"}
        assert connected == pod_addresses - {sc.address}, sc.identity
    keys = chunk_keys("netns-share", 6)
    assert share_through_pool(pool, keys, pool.chunk_bytes, holder=0, reader=2) == (6, 0)


def test_a_stopped_pool_leaves_no_namespace(netns_permitted: None):
    pool = NetnsPool(2, fetch_deadline_seconds=1.0).start()
    prefix = pool.net.prefix
    assert len([n for n in namespaces() if n.startswith(prefix)]) == 3
    pool.stop()
    assert [n for n in namespaces() if n.startswith(prefix)] == []
