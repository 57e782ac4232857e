"""`kv-offload bench transport`: a tiny bounded run; the JSON shape and byte-identical moves.

No speed is asserted here: the numbers are the benchmark's output, not a test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kv_offload_tools.bench.transport.cli import METHODS

CLI = [os.path.join(os.path.dirname(sys.executable), "kv-offload"), "bench", "transport"]


def test_tiny_run_reports_every_method_moving_identical_chunks(tmp_path: Path, shm_dir: str) -> None:
    plot = tmp_path / "transport.png"
    done = subprocess.run(
        [*CLI, "--chunk-bytes", "65536", "--seconds", "0.05", "--rounds", "1",
         "--set-bytes", str(1 << 20), "--json", "--plot", str(plot), "--shm-dir", shm_dir],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    results = {r["method"]: r for r in report["results"]}
    assert set(results) == set(METHODS)
    for method, r in results.items():
        assert r["chunk_bytes"] == 65536
        assert r["gbps_median"] > 0 and r["gbps_min"] <= r["gbps_median"] <= r["gbps_max"]
        assert r["identical"], f"{method} moved bytes that differ from the source"
        assert r["ratio_to_raw_tcp"] > 0
        assert r["cpu_seconds_per_gb"] > 0
        # each side's CPU apart (memcpy has no holder), adding up to both processes'
        assert r["fetcher_cpu_seconds_per_gb"] > 0 and r["holder_cpu_seconds_per_gb"] >= 0
        assert r["holder_cpu_seconds_per_gb"] + r["fetcher_cpu_seconds_per_gb"] == pytest.approx(
            r["cpu_seconds_per_gb"])
    assert results["raw_tcp"]["ratio_to_raw_tcp"] == 1.0
    # holder and fetcher on CPUs of their own (this host has two at least)
    pins = report["pinning"]
    assert pins["holder"] and pins["fetcher"] and not set(pins["holder"]) & set(pins["fetcher"])
    # lanes against raw TCP with as many streams, in the same rounds
    assert {(ln["method"], ln["compared_to"]) for ln in report["lanes"]} == {
        ("tcp_2lanes", "raw_tcp_2streams"), ("tcp_4lanes", "raw_tcp_4streams"), ("tcp_8lanes", "raw_tcp_8streams"),
        ("tls_2lanes", "raw_tcp_2streams")}
    assert {(ln["method"], ln["one_lane"]) for ln in report["lanes"]} == {
        ("tcp_2lanes", "tcp"), ("tcp_4lanes", "tcp"), ("tcp_8lanes", "tcp"), ("tls_2lanes", "tcp+tls")}
    assert all(ln["ratio_to_streams"] > 0 and ln["ratio_to_one_lane"] > 0 for ln in report["lanes"])
    # the fetcher's CPU per GB at 1, 2, 4 and 8 lanes beside raw TCP's receiver with as many streams
    assert [(c["lanes"], c["compared_to"]) for c in report["lanes_cpu"]] == [
        (1, "raw_tcp"), (2, "raw_tcp_2streams"), (4, "raw_tcp_4streams"), (8, "raw_tcp_8streams")]
    assert all(c["fetcher_cpu_seconds_per_gb"] > 0 and c["ratio"] > 0 for c in report["lanes_cpu"])

    tls = results["tcp+tls"]
    assert tls["compared_to"] == "tcp" and tls["ratio_to_twin"] > 0 and tls["cpu_ratio_to_twin"] > 0
    assert report["tls"] == [{"method": "tcp+tls", "compared_to": "tcp", "chunk_bytes": 65536,
                              "throughput_ratio": tls["ratio_to_twin"], "cpu_ratio": tls["cpu_ratio_to_twin"]}]
    lookup = report["lookup"]
    assert lookup["p50_us"] > 0 and lookup["p99_us"] >= lookup["p50_us"]
    assert lookup["ratio_to_raw_rtt"] > 0 and lookup["keys"] == 32
    assert set(lookup["by_transport"]) == {"tcp", "tcp+tls", "ucx_sm", "ucx_tcp", "nixl"}
    # the TCP transport's lookups also while its own fetches stream
    loaded = lookup["by_transport"]["tcp"]["while_fetching"]
    assert loaded["p50_us"] > 0 and loaded["p99_us"] >= loaded["p50_us"]
    assert all("met" in t for t in report["targets"])
    (ceiling,) = report["ceilings"]
    assert ceiling["chunk_bytes"] == 65536
    assert set(ceiling["ratios"]) == {"memcpy", "ucx_sm_limit", "ucx_sm_tagsend", "nixl_bare"}
    assert ceiling["ratios"]["memcpy"] == results["memcpy"]["ratio_to_raw_tcp"]
    # the NIXL path: verified against unverified in the same rounds, idle share, its targets
    nixl = results["nixl"]
    assert nixl["compared_to"] == "nixl_unverified" and nixl["ratio_to_twin"] > 0
    (verify,) = report["verification"]
    assert verify["method"] == "nixl" and verify["throughput_ratio"] == nixl["ratio_to_twin"]
    assert verify["extra_cpu_seconds_per_gb"] == (nixl["cpu_seconds_per_gb"]
                                                  - results["nixl_unverified"]["cpu_seconds_per_gb"])
    idle = report["idle"]["nixl"]
    assert idle["seconds"] > 0 and 0 <= idle["holder_core_share"] and 0 <= idle["fetcher_core_share"]
    assert "idle nixl sidecar process < 2% of a core" in [t["target"] for t in report["targets"]]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[bench transport]" in done.stderr  # progress while running


def test_tls_row_is_measured_beside_plain_tcp_with_its_ratios(shm_dir: str) -> None:
    done = subprocess.run(
        [*CLI, "--chunk-bytes", "65536,262144", "--seconds", "0.05", "--rounds", "1", "--methods", "tcp+tls",
         "--set-bytes", str(1 << 20), "--plot", "", "--shm-dir", shm_dir],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if "identical" in line or "DIFFER" in line]
    assert [(r[0] + " " + r[1], r[2]) for r in rows] == [
        (size, method) for size in ("64 KiB", "256 KiB") for method in ("raw_tcp", "tcp", "tcp+tls")]
    assert all(r[-1] == "identical" for r in rows)  # the plain twin comes along; every byte checked
    for size in ("64 KiB", "256 KiB"):
        assert re.search(rf"^\[tls\] at {size}: tcp\+tls moves \d+\.\d\dx the GB/s of tcp at "
                         r"\d+\.\d\dx its CPU-seconds per GB$", done.stdout, re.MULTILINE), done.stdout


def test_bad_chunk_size_is_one_line_and_exit_2() -> None:
    done = subprocess.run([*CLI, "--chunk-bytes", "2MiB"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--chunk-bytes" in lines[0] and "integers" in lines[0]


def test_ucx_env_reaches_the_ucx_processes_and_is_reported(tmp_path: Path, shm_dir: str) -> None:
    done = subprocess.run(
        [*CLI, "--chunk-bytes", "65536", "--seconds", "0.05", "--rounds", "1", "--methods", "ucx_sm",
         "--set-bytes", str(1 << 20), "--json", "--plot", "", "--shm-dir", shm_dir,
         "--ucx-env", "UCX_RNDV_SCHEME=get_zcopy,UCX_CMA_SEG_SIZE=1m"],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert {r["method"] for r in report["results"]} == {"raw_tcp", "ucx_sm"}
    assert all(r["identical"] for r in report["results"])
    settings = report["ucx_settings"]["ucx_sm"]
    assert settings["UCX_RNDV_SCHEME"] == "get_zcopy"  # overrides the transport's put_zcopy
    assert settings["UCX_CMA_SEG_SIZE"] == "1m" and settings["UCX_TLS"] == "sm,self"


def test_bad_ucx_env_item_is_one_line_and_exit_2() -> None:
    done = subprocess.run([*CLI, "--ucx-env", "RNDV_SCHEME=get_zcopy"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ucx-env" in lines[0] and "'RNDV_SCHEME=get_zcopy'" in lines[0]


def test_nixl_targets_compare_with_memcpy_and_raw_tcp_of_the_same_run() -> None:
    from kv_offload_tools.bench.transport.report import targets

    def row(method: str, ratio: float, cpu: float) -> dict:
        return {"method": method, "chunk_bytes": 2097152, "ratio_to_raw_tcp": ratio, "cpu_seconds_per_gb": cpu}

    report = {"results": [row("raw_tcp", 1.0, 0.6), row("memcpy", 4.0, 0.2), row("nixl", 2.6, 0.25),
                          row("nixl_unverified", 3.0, 0.19)],
              "idle": {"nixl": {"seconds": 3.0, "holder_core_share": 0.004, "fetcher_core_share": 0.03}}}
    got = {t["target"]: (round(t["ratio"], 4), t["met"]) for t in targets(report)}
    assert got == {
        "NIXL peer fetch, verified >= 0.6x memcpy at 2 MiB": (0.65, True),
        "NIXL peer fetch, unverified >= 0.8x memcpy at 2 MiB": (0.75, False),
        "NIXL peer fetch CPU-seconds per GB <= 1/3 of raw TCP's at 2 MiB": (0.4167, False),
        "idle nixl sidecar process < 2% of a core": (0.03, False),  # the busier of the two processes
    }
