"""The figures of `bench vllm` made of what it measured: an inter-token window's statistics,
repeated runs as one figure (the median window, the median hit), and costs per GB.

A single TTFT or ITL window is one sample on a shared host: two CPU-tier hits of one
prefix 0.2-0.5 s long differ by tens of milliseconds from run to run, as much as the
own-sidecar target's whole margin, and a window's p99 is its one slowest step. So the
bench repeats them (``vllm_ttft_plan.HIT_RUNS``, ``WINDOW_RUNS``) and reports the median
run, with every run listed beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np

from kv_offload_tools.bench.vllm_ttft.probes import TIER_CPU_SECONDS

__all__ = ["engine_cpu", "itl_stats", "itl_window", "median_hit", "median_window", "per_gb",
           "per_wait"]


def itl_window(reply: Mapping[str, Any]) -> list[float]:
    """D's intervals after the traffic request was added (or the quiet mark), without the
    one step that prefilled the traffic request."""
    times = reply["token_times_s"]
    start = reply["window_start_s"]
    skip = reply["compute_interval_index"]
    return [iv for i, (iv, end) in enumerate(zip(reply["intervals_s"], times[1:]))
            if end > start and i != skip]


def itl_stats(window: list[float], *, with_intervals: bool = False) -> dict[str, Any]:
    """Count, p50, p99, max and mean (ms) of a window's intervals (seconds); with
    ``with_intervals`` each interval too, in order, so a slow step can be placed (first
    after the traffic's prefill, or spread over the transfer)."""
    out: dict[str, Any] = {"intervals": len(window)}
    if with_intervals:
        out["intervals_ms"] = [round(iv * 1e3, 1) for iv in window]
    if window:
        ms = np.array(window) * 1e3
        out.update(p50_ms=float(np.percentile(ms, 50)), p99_ms=float(np.percentile(ms, 99)),
                   max_ms=float(ms.max()), mean_ms=float(statistics.fmean(ms)))
    else:
        out.update(p50_ms=None, p99_ms=None, max_ms=None, mean_ms=None)
    return out


def median_window(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Traffic windows of one kind as one figure: the window whose p99 is the median (its
    p50, intervals and end state with it; an odd count), each window under ``runs``."""
    timed = [w for w in windows if w["p99_ms"] is not None]
    middle = _median_by(timed, "p99_ms") if timed else windows[0]
    return {**middle, "runs": windows}


def median_hit(hits: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated hits of one source as one figure: the hit whose TTFT is the median (its
    phases, CPU and counters with it; an odd count), each run's TTFT under ``ttft_runs_s``
    and whether it was a full hit under ``full_hit_runs``."""
    middle = _median_by(hits, "ttft_s")
    return {**middle, "ttft_runs_s": [h["ttft_s"] for h in hits],
            "full_hit_runs": [h.get("hit") for h in hits]}


def _median_by(runs: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """The run whose ``field`` is the median (the lower middle of an even count)."""
    return sorted(runs, key=lambda r: r[field])[(len(runs) - 1) // 2]


def per_gb(seconds: float | None, nbytes: int) -> float | None:
    return None if seconds is None or nbytes <= 0 else seconds / (nbytes / 1e9)


def per_wait(total: float | None, count: float | None, waits: float | None) -> float | None:
    """``total`` over ``count`` requests; the tier counts only requests that waited, so none
    waiting is 0, while a counter vLLM does not expose (or none counted among requests that
    waited: the sidecar did not say when it knew) is missing."""
    if total is None or count is None or waits is None:
        return None
    if count:
        return total / count
    return None if waits else 0.0


def engine_cpu(d: Mapping[str, Any], engine_role: str, nbytes: int) -> dict[str, Any]:
    """CPU of an engine-core process over a delta: the whole process, its threads other than
    the scheduler's, and the tier's own code (its threads and the scheduler inside its calls)."""
    total = d["cpu_s"].get(engine_role)
    off_main = d["cpu_s"].get(f"{engine_role}.off_main")
    tier = d["vllm"].get(f"{engine_role.removeprefix('engine_')}:{TIER_CPU_SECONDS}")
    return {"engine_cpu_s": total, "engine_cpu_s_per_gb": per_gb(total, nbytes),
            "engine_off_main_cpu_s": off_main,
            "engine_off_main_cpu_s_per_gb": per_gb(off_main, nbytes),
            "tier_cpu_s": tier, "tier_cpu_s_per_gb": per_gb(tier, nbytes)}
