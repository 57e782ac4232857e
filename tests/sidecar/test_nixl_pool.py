"""Two sidecar processes with the nixl data plane: chunks stored through one are READ by the
other straight from its store slots, byte-identical; the holder's views die with the links."""

from __future__ import annotations


from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, share_through_pool
from kv_offload_testing.local_pool import LocalPool
from waiting import wait_for

CHUNK_SLOTS = 64


def test_a_nixl_pool_shares_chunks_byte_identical_over_the_read_lanes_each_sidecar_offers():
    with LocalPool(2, transport="nixl", capacity_bytes=CHUNK_SLOTS * 16384 * 16,
                   fetch_deadline_seconds=5.0, extra_args=("--lanes", "3")) as pool:
        chunk = pool.chunk_bytes
        assert all(sc.status()["data_address"].startswith("nixl://") for sc in pool.sidecars)
        wait_for("each sidecar's link to the other", lambda: all(
            any(p["state"] == "connected" for p in sc.peers()) for sc in pool.sidecars))
        keys = chunk_keys("nixl-pool", 12)
        assert share_through_pool(pool, keys, chunk, timeout=5.0) == (12, 0)
        # one-sided reads: the fetcher's data link (opened by its read) runs its own read
        # threads, whatever the holder offers; the holder opened none
        assert [sc.status()["data_lanes"] for sc in pool.sidecars] == [{}, {pool[0].identity: 3}]
        assert pool[1].metric("kv_offload_peer_data_lanes") == 3
        with pool.client(1) as b:
            # Read again: b kept no copy (the pool keeps one, a's), so a's slots are read again.
            assert load_and_verify(b, keys, chunk, timeout=5.0) == (12, 0)
        assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") == 24 * chunk
        assert pool[1].metric("kv_offload_peer_fetches_total", result="ok") >= 1
        assert pool[1].metric("kv_offload_integrity_failures_total") == 0
        # the holder counts a chunk as sent when the fetcher releases its lease
        wait_for("the holder counting every chunk sent",
                 lambda: pool[0].metric("kv_offload_peer_bytes_total", direction="sent") >= 24 * chunk)
        assert pool[0].metric("kv_offload_peer_bytes_total", direction="sent") == 24 * chunk


def test_nixl_sidecars_stopped_by_sigterm_exit_0_every_time():
    """A stop is a clean exit, not a crash in a library's destructor (the image's nixl
    sidecars once exited 139 at every stop)."""
    for round_no in range(2):
        pool = LocalPool(2, transport="nixl", capacity_bytes=CHUNK_SLOTS * 16384 * 16).start()
        try:
            keys = chunk_keys(f"nixl-stop-{round_no}", 4)
            assert share_through_pool(pool, keys, pool.chunk_bytes, timeout=5.0) == (4, 0)
        finally:
            codes = pool.stop()
        assert codes == {"sidecar-0": 0, "sidecar-1": 0}
