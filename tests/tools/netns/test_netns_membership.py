"""Pods that come and go, an address taken over by another pool, a resolver that fails and a
cluster domain that is not cluster.local, with real sidecars in pod namespaces
(``bench.netns_faults``): links follow the live members, descriptors and memory stay flat,
a stranger at a departed member's address raises bounded ``other_pool`` refusals (never
``bad_proof``), and discovery keeps its members while the resolver is down."""

from __future__ import annotations

from kv_offload_tools.bench.netns.faults import (
    FD_SLACK,
    RSS_SLACK_BYTES,
    churn,
    resolver_outage,
    reused_address,
)
from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
from kv_offload_tools.netns.ip import NetnsError, in_netns
from kv_offload_tools.netns.pool import NetnsPool

# Refusals one member may count in the few seconds a stale answer lists the stranger: its link
# backs off (0.5 s, doubling, jittered), so a handful, not one per retry of a fixed interval.
MAX_REFUSALS_WHILE_LISTED = 6


def resolves(pool: NetnsPool, name: str) -> bool:
    """Whether the system resolver inside pod 0 finds ``name`` (its hosts file, resolv.conf)."""
    try:
        in_netns(pool.pod(0).netns, ["getent", "ahostsv4", name])
    except NetnsError:
        return False
    return True


def test_pods_stopped_and_started_leave_links_to_live_members_only_and_flat_footprints(netns_permitted: None):
    with NetnsPool(5, fetch_deadline_seconds=1.0) as pool:
        figures = churn(pool, stay=[0, 1], rounds=2)
    for r in figures["rounds"]:
        assert r["departed_links_left"] == 0, figures
        assert r["seconds_until_departed_forgotten"] is not None, figures  # the address left discovery
        assert r["shared"] == [4, 0], figures  # a pod started again shares with a survivor
    assert figures["growth_over_round_1"]["fds"] <= FD_SLACK, figures
    assert figures["growth_over_round_1"]["rss_mib"] <= RSS_SLACK_BYTES / 2**20, figures


def test_a_departed_pods_address_taken_by_another_pool_is_refused_as_other_pool_a_few_times(
        netns_permitted: None):
    with NetnsPool(3, fetch_deadline_seconds=1.0) as pool:
        figures = reused_address(pool, 2, stale_seconds=4.0)
        assert figures["refused_by_all"], figures
        for refusals in figures["member_refusals"].values():
            assert refusals["bad_proof"] == 0, figures  # nothing an alert pages for
            assert 1 <= refusals["other_pool"] <= MAX_REFUSALS_WHILE_LISTED + 2, figures
        assert all(n <= MAX_REFUSALS_WHILE_LISTED for n in figures["member_refusals_while_listed"].values()), figures
        assert figures["other_pool_sidecar_refusals"]["bad_proof"] == 0, figures
        assert figures["seconds_from_unlisted_to_forgotten"] is not None, figures
        # the members still share with each other
        assert share_through_pool(pool, chunk_keys("after-reuse", 4), pool.chunk_bytes, holder=0, reader=1) == (4, 0)


def test_a_failing_resolver_tears_no_link_down(netns_permitted: None):
    with NetnsPool(3, fetch_deadline_seconds=1.0) as pool:
        figures = resolver_outage(pool, seconds=0.0)
    assert figures["every_pod_failed_to_resolve"], figures
    assert figures["connected_before"] == 6 and figures["links_lost"] == 0, figures
    assert figures["shared_during"] == [4, 0], figures


def test_pods_whose_resolver_names_another_cluster_domain_find_each_other(netns_permitted: None):
    # The hosts files name kvo.ns.svc.cluster.example only, and resolv.conf's search list
    # (ns.svc.cluster.example svc.cluster.example) cannot complete "kvo.ns.svc" to it: the pods
    # connect only when the sidecar takes the domain from resolv.conf.
    with NetnsPool(3, pool_name="kvo.ns.svc", cluster_domain="cluster.example",
                   fetch_deadline_seconds=1.0) as pool:
        assert pool.net.resolved_name == "kvo.ns.svc.cluster.example"
        assert resolves(pool, "kvo.ns.svc.cluster.example") and not resolves(pool, "kvo.ns.svc")
        assert share_through_pool(pool, chunk_keys("domain", 4), pool.chunk_bytes, holder=0, reader=2) == (4, 0)
