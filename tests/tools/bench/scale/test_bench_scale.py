"""`kv-offload bench scale`: a small run through the CLI, and the measurements it stands on."""

from __future__ import annotations

import random
import tracemalloc

from kv_offload_sidecar.peers.directory.holders import Directory
from kv_offload_sidecar.peers.directory.location_wire import PublishBatch
from kv_offload_sidecar.peers.directory.ownership import OwnerTable
from kv_offload_sidecar.peers.directory.publisher import Publisher
from kv_offload_tools.bench.scale.measure import deep_size, http_overhead
from kv_offload_tools.bench.scale.sample import SampledView
from recorded_run import recorded_run
from refusal import bench, refusal

FIELDS = ("pods", "location_bytes_per_sidecar", "control_bytes_per_second_per_pod",
          "messages_per_peer_hit_request", "false_positive_ratio", "hit_ratio_vs_exact",
          "messages_per_lookup", "by_holders", "join", "leave", "alternatives", "meets_targets",
          "links_per_sidecar", "links")


def _weighted(by_holders: dict) -> float:
    """Messages per peer-hit request as the holders' breakdown adds them up."""
    return sum(v["share"] * v["messages_per_request"] for v in by_holders.values())


def test_small_run_reports_every_figure_and_they_move_the_right_way_with_pods(tmp_path):
    plot = tmp_path / "scale.png"
    report, record, stderr = recorded_run("scale", ["--pods", "8,32", "--chunks-per-pod", "2000",
                                                    "--changes-per-second", "100", "--seconds", "3",
                                                    "--read-replicas", "4", "--read-sessions", "40",
                                                    "--plot", str(plot)], tmp_path)
    assert "[scale x32]" in stderr  # progress while it runs
    assert [row[0] for row in record["tables"][0]["rows"]] == ["8", "32"]
    assert record["figures"]["location_memory_largest_pool"] == record["tables"][0]["rows"][1][1]
    small, large = report["results"]
    for row in (small, large):
        for name in FIELDS:
            assert name in row, name
        # The sidecar's read: an owner question and an exchange per holder, a question for the end.
        assert row["meets_targets"]["messages_per_peer_hit_request"]
        assert "1" in row["by_holders"]
        assert abs(_weighted(row["by_holders"]) - row["messages_per_peer_hit_request"]) < 1e-9
        assert 1.0 < row["messages_per_peer_hit_request"] < 2 * max(int(k) for k in row["by_holders"]) + 2
        assert 0 <= row["false_positive_ratio"] <= 0.1
        # (2000 chunks at 100 changes/s live 40 s: staleness costs more than at full size, where
        # the run above the README's table finds 0.97+ of exact)
        assert row["hit_ratio_vs_exact"] >= 0.85
        assert row["sampled_sidecars"] == 2 and row["modelled_sidecars"] == row["pods"] - 2
        # a joiner receives about one store's worth of entries, whatever the pool's size
        assert 0.5 * 2000 < row["join"]["joiner_entries_received"] < 2.0 * 2000
        # Links per sidecar: the holders a member read from within an idle window (its own data
        # links), at most the pool; its publishes reach more of the pool than it reads from.
        links = row["links"]
        assert 1 <= row["links_per_sidecar"] == links["holders_read_from_per_window"]["max"] <= row["pods"] - 1
        assert links["readers_per_window"]["max"] <= links["data_peers_per_window"]["max"] <= row["pods"] - 1
        assert links["max_data_links"] == 64 and links["control_within_bound"]
        assert links["data_peers_per_window"]["mean"] <= links["publish_peers_per_window"]["max"] <= row["pods"] - 1
        assert links["control_connection_opens_per_second"] >= 0
    assert (small["pods"], large["pods"]) == (8, 32)
    # Per-sidecar memory stays put as the pool quadruples; the exact sets grow with the peers.
    assert large["location_bytes_per_sidecar"] < 1.5 * small["location_bytes_per_sidecar"]
    exact_growth = large["alternatives"]["exact"]["memory_bytes"] / small["alternatives"]["exact"]["memory_bytes"]
    assert abs(exact_growth - 31 / 7) < 0.01
    # Traffic grows less than the exact scheme's pulls (which grow with the peers).
    dir_growth = large["control_bytes_per_second_per_pod"] / small["control_bytes_per_second_per_pod"]
    pull_growth = (large["alternatives"]["exact"]["bytes_per_second_each_way"]
                   / small["alternatives"]["exact"]["bytes_per_second_each_way"])
    assert dir_growth < pull_growth
    # Each member's share of a join or a leave shrinks as the pool grows.
    assert large["join"]["entries_sent_by_each_member"] < small["join"]["entries_sent_by_each_member"]
    assert large["leave"]["entries_resent_by_each_member"] < small["leave"]["entries_resent_by_each_member"]
    assert set(report["targets"]) | {"messages_per_peer_hit_request"} == set(large["meets_targets"])
    # bench replay's conversations over 4 replicas: turns on different pods, prefixes on several holders.
    read, = report["reads"]
    assert (read["workload"], read["replicas"], read["requests"]) == ("conversation", 4, 240)
    assert read["within_bound"] and max(int(k) for k in read["by_holders"]) >= 2
    assert read["all_messages_per_peer_hit_request"] >= read["messages_per_peer_hit_request"] > 2.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_pod_counts_are_refused_with_one_line():
    assert "--pods '8,x' must be comma-separated integers" in refusal(bench("scale"), "--pods", "8,x")


def test_deep_size_counts_what_tracemalloc_sees_of_a_publisher_and_a_directory():
    rng = random.Random(1)
    digests = [rng.getrandbits(64) for _ in range(30_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        pub, directory = Publisher("a"), Directory()
        for d in digests:
            pub.record_digest(d, True)
        directory.apply("h", PublishBatch("ab", 1, True, False, tuple((d, d & 0xFFFF) for d in digests), ()))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    traced = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    assert abs(deep_size(pub, directory) - traced) < 0.15 * traced


def test_a_modelled_member_sends_the_sampled_owners_exactly_what_a_full_member_would():
    table = OwnerTable("pod-0")
    for i in range(1, 12):
        table.add(f"pod-{i}")
    sampled = ["pod-0", "pod-1"]
    mine = table.owned_mask("pod-0") | table.owned_mask("pod-1")
    rng = random.Random(2)
    digests = [rng.getrandbits(64) for _ in range(5000)]
    full, modelled = Publisher("pod-7", epoch="aa"), Publisher("pod-7", epoch="aa")
    for owner in table.members():
        full.owner_joined(owner)
    for owner in sampled:
        modelled.owner_joined(owner)
    for d in digests:
        full.record_digest(d, True)
        if mine[d >> 48]:
            modelled.record_digest(d, True)
    def sent(messages) -> dict:
        return {o: [(b.seq, b.reset, frozenset(b.adds), frozenset(b.removes)) for b in bs] for o, bs in messages}

    def both_send_the_same() -> None:
        a = {o: m for o, m in sent(full.take(table)).items() if o in sampled}
        b = sent(modelled.take(SampledView(table, sampled)))  # type: ignore[arg-type]
        assert a == b and a

    both_send_the_same()  # the first shares
    for d in digests[:700]:  # then a round of changes
        full.record_digest(d, False)
        if mine[d >> 48]:
            modelled.record_digest(d, False)
    both_send_the_same()


def test_http_overhead_is_measured_on_a_real_exchange():
    o = http_overhead(samples=2)
    assert 150 < o.request < 600 and 60 < o.response < 400  # headers, not bodies
