"""`kv-offload bench mesh`: a tiny run of real sidecars through the CLI, and its target check."""

from __future__ import annotations

import pytest
from kv_offload_tools.bench.mesh.report import (
    PHASES,
    descriptor_order,
    within_pool_slope,
)
from recorded_run import recorded_run
from refusal import bench, refusal


def test_tiny_run_reads_every_sidecar_in_every_phase_and_judges_the_target(tmp_path):
    plot = tmp_path / "mesh.png"
    report, record, stderr = recorded_run("mesh", ["--pods", "2,3", "--chunks", "4", "--settle-seconds", "0.5",
                                                   "--idle-seconds", "1", "--plot", str(plot)], tmp_path)
    assert "[mesh x3] after_idle" in stderr  # progress while it runs
    assert [row[0] for row in record["tables"][0]["rows"]] == ["2", "3"]
    assert [r["pods"] for r in report["results"]] == [2, 3]
    for row in report["results"]:
        n = row["pods"]
        join = row["join"]
        assert 0 < join["ready_seconds"] <= join["settled_seconds"]
        assert join["handshakes"]["rejected"] == 0
        # Each end counts a handshake; the reads made at least one link.
        assert join["handshakes_at_end"]["accepted"] >= 2
        work = row["workload"]
        assert work["stored"] == work["expected_stored"] == len(work["writers"]) * 4
        assert work["loaded"] == work["expected_loaded"] > 0 and work["wrong"] == 0
        for phase in PHASES:
            sidecars = row["phases"][phase]["sidecars"]
            assert len(sidecars) == n
            for s in sidecars:
                assert s["members"] == n
                assert 0 < s["sockets"] < s["fds"] < 1024
                assert 1 <= s["threads"] < 200
                assert 10 << 20 < s["rss_anon_bytes"] < s["rss_bytes"] < 1 << 30
                assert 0 <= s["data_linked_peers"] <= s["known_peers"] <= n - 1
                assert s["data_lanes"] >= s["data_linked_peers"]
            fds = row["phases"][phase]["summary"]["fds"]
            assert fds["min"] <= fds["mean"] <= fds["max"]
    verdict = report["descriptors"]
    slopes = [verdict["per_phase"][p]["descriptors_per_extra_pod"] for p in ("joined", "after_idle")]
    assert verdict["meets_target"] == (max(slopes) <= 1.0)
    assert verdict["order"] == ("O(links)" if verdict["meets_target"] else "O(pool)")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rows(fds_by_pods: dict[int, float], linked: int = 1) -> list[dict]:
    """Reports' rows whose every phase has one sidecar with ``fds`` descriptors."""
    def phase(fds: float) -> dict:
        return {"summary": {"fds": {"mean": fds, "min": fds, "max": fds}},
                "sidecars": [{"fds": fds, "data_linked_peers": linked}]}
    return [{"pods": n, "phases": {p: phase(fds) for p in PHASES}} for n, fds in fds_by_pods.items()]


def test_descriptors_that_grow_with_the_pool_miss_the_target():
    verdict = descriptor_order(_rows({8: 58.0, 16: 106.0, 32: 202.0}), max_per_pod=1.0)
    assert verdict["per_phase"]["joined"]["descriptors_per_extra_pod"] == pytest.approx(6.0)
    assert (verdict["order"], verdict["meets_target"]) == ("O(pool)", False)


def test_descriptors_flat_while_idle_meet_the_target():
    verdict = descriptor_order(_rows({8: 30.0, 16: 30.5, 32: 31.0}), max_per_pod=1.0)
    assert (verdict["order"], verdict["meets_target"]) == ("O(links)", True)


def test_one_pod_count_is_not_judged():
    verdict = descriptor_order(_rows({8: 30.0}), max_per_pod=1.0)
    assert verdict["meets_target"] is None and verdict["order"].startswith("unknown")


def test_descriptors_per_data_link_come_from_sidecars_of_one_pool_that_differ():
    # Two pools whose sessions cost different amounts: only the difference within each counts.
    assert within_pool_slope([[(0, 10), (1, 14), (2, 18)], [(0, 50), (1, 54)]]) == pytest.approx(4.0)
    assert within_pool_slope([[(3, 10), (3, 12)], [(7, 30)]]) is None


def test_bad_pod_counts_are_refused_with_one_line():
    assert refusal(bench("mesh"), "--pods", "8,1") == (
        "kv-offload bench mesh: --pods '8,1' needs pod counts from 2 to 64")
