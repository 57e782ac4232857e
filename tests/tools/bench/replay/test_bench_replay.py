"""`kv-offload bench replay`: a small bounded replay against real sidecars."""

import json
import math
import os
import subprocess
import sys

from kv_offload_tools.bench.replay import cli as replay
from kv_offload_tools.mooncake_trace import TRACE_SAMPLE, load_trace
from recorded_run import recorded_run

FIELDS = ("p2p_hit_ratio", "local_only_hit_ratio", "pooled_lru_hit_ratio", "ideal_hit_ratio",
          "lookup_messages_per_request", "bytes_moved")


def _cli(*args, timeout=200):
    exe = os.path.join(os.path.dirname(sys.executable), "kv-offload")
    return subprocess.run([exe, "bench", "replay", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_replay_json_reports_consistent_hit_ratios_from_real_sidecars(tmp_path):
    plot = tmp_path / "replay.png"
    args = ["--trace", str(TRACE_SAMPLE), "--replicas", "3", "--capacity-chunks", "400",
            "--chunk-bytes", "4096", "--routing", "round-robin", "--limit", "150", "--plot", str(plot)]
    report, record, stderr = recorded_run("replay", args, tmp_path, timeout=200)
    (run,) = [t for t in record["tables"] if t["title"] == "The run"]
    assert run["rows"][0][:3] == [report["workload"], "3", "round-robin"]
    assert record["figures"]["hit_ratio_vs_one_lru"].endswith("x")
    for name in FIELDS:
        assert isinstance(report[name], (int, float)), name
    assert report["requests"] == 150 and report["mismatched_chunks"] == 0
    assert 1.0 >= report["ideal_hit_ratio"] >= report["pooled_lru_hit_ratio"] - 1e-9
    assert report["pooled_lru_hit_ratio"] >= report["local_only_hit_ratio"] > 0
    # Sharing beats isolated caches, and never beats one cache of the same total size.
    assert report["p2p_hit_ratio"] > report["local_only_hit_ratio"]
    assert report["p2p_hit_ratio"] <= report["ideal_hit_ratio"] + 1e-9
    # Chunks moved between sidecars; a peer hit may find a kept local copy, so
    # bytes_moved is at least one chunk but need not cover every peer hit.
    assert report["p2p_peer_hits"] > 0 and report["bytes_moved"] >= 4096
    assert report["lookup_messages_per_request"] > 0
    # Every request that loaded from a peer sent at least its fetch message.
    assert 1.0 <= report["lookup_messages_per_peer_hit_request"]
    # One exchange with one holder per peer-hit request (a few more when a named holder had
    # lost the chunk), and at most one question to a directory owner per request.
    assert 1.0 <= report["holder_exchanges_per_peer_hit_request"] < 1.5
    assert 0 < report["owner_queries_per_request"] <= 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[replay p2p x3] 150/150 requests" in stderr


def test_simulated_lru_bounds_are_ordered():
    trace = load_trace(TRACE_SAMPLE)
    keys = replay.request_keys(trace)
    routes = replay.route(trace, 4, "round-robin")
    ideal = replay.simulate_lru(keys, [0] * len(keys), 1, math.inf)
    pooled = replay.simulate_lru(keys, [0] * len(keys), 1, 4 * 100)
    local = replay.simulate_lru(keys, routes, 4, 100)
    assert ideal >= pooled >= local > 0
    assert replay.simulate_lru(keys, [0] * len(keys), 1, 1) <= pooled


def test_chunk_keys_follow_the_prefix_chain_of_hash_ids():
    keys = replay.request_keys([[1, 2, 3], [1, 2, 4], [9, 2, 3]])
    assert keys[0][:2] == keys[1][:2] and keys[0][2] != keys[1][2]
    assert not set(keys[0]) & set(keys[2])  # same ids after another first block differ
    assert all(len(k) == 36 for k in keys[0])


def test_prefix_aware_routing_keeps_a_prefix_on_one_replica():
    trace = [[1, 2], [5, 6], [1, 2, 3], [7], [5, 6, 8]]
    assert replay.route(trace, 3, "prefix-aware") == [0, 1, 0, 2, 1]
    assert replay.route(trace, 3, "round-robin") == [0, 1, 2, 0, 1]
    assert set(replay.route(trace, 3, "random")) <= {0, 1, 2}


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    out = _cli("--trace", str(TRACE_SAMPLE), "--replicas", "0", "--capacity-chunks", "10")
    assert out.returncode == 2 and out.stdout == ""
    assert "--replicas" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    missing = _cli("--trace", str(tmp_path / "nope.jsonl"), "--replicas", "2",
                   "--capacity-chunks", "10")
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr


def test_replay_of_a_generated_conversation_with_session_affine_routing(tmp_path):
    trace = tmp_path / "conversation.jsonl"
    out = _cli("--generate", "conversation", "--sessions", "16", "--turns", "3", "--replicas", "2",
               "--capacity-chunks", "200", "--routing", "session-affine", "--plot", "",
               "--write-trace", str(trace), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["workload"] == "conversation 16x3, think 20 s" and report["requests"] == 48
    assert report["mismatched_chunks"] == 0
    # every later turn finds its session's earlier prompt where the session lives
    assert report["p2p_hit_ratio"] > 0.3 and report["local_only_hit_ratio"] > 0.3
    assert len(trace.read_text().splitlines()) == 48


def test_replay_needs_exactly_one_request_source():
    out = _cli("--replicas", "2", "--capacity-chunks", "10")
    assert out.returncode == 2 and "--trace FILE or --generate conversation" in out.stderr


def test_prefix_hint_routing_follows_the_sidecars_hints_and_moves_fewer_bytes_than_round_robin(tmp_path):
    common = ("--generate", "conversation", "--sessions", "24", "--turns", "4", "--replicas", "3",
              "--capacity-chunks", "400", "--plot", "", "--json")
    hinted = _cli(*common, "--routing", "prefix-hint")
    spread = _cli(*common, "--routing", "round-robin")
    assert hinted.returncode == 0, hinted.stderr
    assert spread.returncode == 0, spread.stderr
    h, r = json.loads(hinted.stdout), json.loads(spread.stdout)
    assert h["mismatched_chunks"] == r["mismatched_chunks"] == 0
    # Later turns go where their session's prefix is: most requests follow a hint ...
    assert h["hinted_requests"] > h["requests"] / 2 and h["hint_messages_per_request"] > 0
    assert r["hinted_requests"] == 0
    # ... so their hits are local and little moves; round-robin fetches every turn's prefix.
    assert h["bytes_moved_per_hit"] < r["bytes_moved_per_hit"] / 2
    assert h["p2p_hit_ratio"] >= r["p2p_hit_ratio"] - 0.02
    assert "[replay p2p prefix-hint x3]" in hinted.stderr
    # The prefill model prices both runs, per modelled link.
    assert [row["link_gb_per_second"] for row in h["prefill"]] == [1.25, 25.0]
    # Both reports side by side, in a table and a plot.
    (tmp_path / "h.json").write_text(hinted.stdout)
    (tmp_path / "r.json").write_text(spread.stdout)
    plot = tmp_path / "routings.png"
    both = _cli("--compare", f"{tmp_path / 'h.json'},{tmp_path / 'r.json'}", "--plot", str(plot))
    assert both.returncode == 0, both.stderr
    rows = [line.split() for line in both.stdout.splitlines()[2:4]]
    assert [row[0] for row in rows] == ["prefix-hint,", "round-robin,"]
    assert float(rows[0][2]) == round(h["p2p_hit_ratio"], 4)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = _cli("--compare", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "missing.json" in bad.stderr
