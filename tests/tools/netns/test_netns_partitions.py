"""Partitions between real pods: the chunk directory is exact again after a heal, and a pod cut
from one member's control port still finds what a third pod holds."""

from __future__ import annotations

from kv_offload_tools.bench.netns.scenarios import asymmetric, isolate_and_heal
from kv_offload_tools.netns.pool import NetnsPool


def test_after_a_pod_is_cut_off_and_healed_the_directory_is_exact_again(netns_pool: NetnsPool):
    pool = netns_pool
    # every pod stores and reads throughout: the cut ends links, the heal joins them again
    # while publishes flow (some cross the joins)
    isolate_and_heal(pool, 2, before=2.0, during=4.0, after=2.0)
    pool.wait_connected(30)
    pool.wait_directory_current(15)  # owners keep one entry per chunk held and owner


def test_a_pod_that_cannot_dial_another_still_finds_what_a_third_pod_stores(netns_pool: NetnsPool):
    pool = netns_pool
    pool.wait_connected(30)
    figures = asymmetric(pool, 0, 1, 2, before=2.0, during=5.0)
    assert not figures["errors"]
    for reader, windows in figures["readers"].items():
        assert windows["during"]["requests"] > 0 and windows["during"]["hit_ratio"] >= 0.95, (reader, figures)
    # the pod that cannot dial its peer shows it; the others reach everyone
    assert figures["unreachable_peers"] == {"pod-0": 1.0, "pod-1": 0.0, "pod-2": 0.0}, figures
