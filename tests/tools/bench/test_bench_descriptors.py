"""`kv-offload bench descriptors`: the demo runs side by side without and with every process
holding descriptors past 1,024, and the second run shares chunks as the first does."""

from __future__ import annotations

import pytest
from refusal import bench, refuses_each

from kv_offload_tools.bench.descriptors import compare, format_table

CLI = bench("descriptors")


def test_a_pool_past_1024_descriptors_shares_chunks_and_fails_no_load() -> None:
    # Every socket of the second run lies past 1,024: a select.select anywhere fails its lookups
    # (no peer hit). The ratio itself is the bench's to judge on its 300 requests: on 40 it is
    # timing (a chunk stored meanwhile is not found yet), and this host is shared.
    figures = compare(pods=2, requests=40, descriptors=1100, seconds=60.0)
    plain, held = figures["runs"]
    assert (plain["descriptors"], held["descriptors"]) == (0, 1100)
    assert held["peer_hits"] > 0, f"no chunk moved between pods holding 1,100 descriptors\n{format_table(figures)}"
    assert held["failed_loads"] == 0 and held["mismatched_bytes"] == 0, format_table(figures)
    assert figures["ratio"] == pytest.approx(held["hit_ratio"] / plain["hit_ratio"])


test_bad_input_is_one_line_and_exit_2 = refuses_each(CLI, {
    "pods": (["--pods", "1"], "--pods 1: at least 2, so pods share chunks"),
    "requests": (["--requests", "0"], "--requests 0: at least 1"),
    "descriptors": (["--descriptors", "0"], "--descriptors 0: at least 1 (1,100 puts sockets past 1,024)"),
})
