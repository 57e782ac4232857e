"""The store window's reference without offloading, measured on the baseline engine.

A store window holds more than offload traffic: it starts with the traffic request's
prefill, and the decoding request's first steps after a large prefill run slow on an engine
with no offloading at all (caches and pages the prefill took; up to 1.4x the quiet p99 at
512 MiB here). So the store window is compared with the same window on the baseline engine
(vLLM without a connector): D decodes while a fresh prefix of the same size is prefilled
beside it, and for ``AFTER_PREFILL_TOKENS`` tokens after that prefix's first token.

The baseline runs before the planes (or beside the first plane's idle engines), when the
host may run faster or slower; so what is carried over is a ratio of that sitting,
``prefill_over_quiet``: the median over ``PREFILL_RUNS`` windows of each window's p99, over
the baseline's own quiet p99 (two quiet runs pooled, as on the planes). A plane's store
window is then measured against its own quiet p99 times that ratio
(``store_over_no_offload``)."""

from __future__ import annotations

import statistics
from typing import Any

from kv_offload_tools.bench.vllm_ttft_measure import (
    QUIET_TOKENS, WARM_TOKENS, itl_stats, itl_window, progress)
from kv_offload_tools.bench.vllm_ttft_plan import Plan, decode_prompt, prefix_prompt

__all__ = ["AFTER_PREFILL_TOKENS", "PREFILL_RUNS", "no_offload_reference",
           "store_over_no_offload"]

# Tokens D decodes after the prefilled prefix's first token: about what a 512 MiB store
# window holds here before its bytes land (15-25 intervals).
AFTER_PREFILL_TOKENS = 20
# Prefill windows measured; their p99s' median is the reference (each window is one sample,
# as a plane's store window is).
PREFILL_RUNS = 3


def no_offload_reference(baseline: Any, plan: Plan) -> dict[str, Any]:
    """Quiet and prefill-beside windows of the baseline engine, and their p99 ratio."""
    size = plan.itl_size_mib
    kwargs = {"warm_tokens": WARM_TOKENS, "quiet_tokens": QUIET_TOKENS,
              "max_decode_tokens": plan.max_decode_tokens}
    quiet = [baseline.decode_latency(decode_prompt("quiet"), None, **kwargs) for _ in range(2)]
    prefill = [baseline.decode_latency(decode_prompt("store"),
                                       prefix_prompt(plan, size, f"itl-no-offload-{i}"),
                                       tokens_after_traffic=AFTER_PREFILL_TOKENS, **kwargs)
               for i in range(PREFILL_RUNS)]
    ended = {r["window_end"] for r in prefill}
    if ended != {"tokens_after_traffic"}:
        raise RuntimeError(f"a no-offload prefill window ended on {sorted(ended)}, not after "
                           f"{AFTER_PREFILL_TOKENS} tokens: raise --max-decode-tokens")
    q = itl_stats([iv for r in quiet for iv in itl_window(r)])
    runs = [itl_stats(itl_window(r)) for r in prefill]
    for stats, reply in zip(runs, prefill):
        stats["intervals_ms"] = [round(iv * 1e3, 1) for iv in itl_window(reply)]
    p99 = statistics.median(r["p99_ms"] for r in runs)
    out = {"size_mib": size, "quiet": q, "prefill_runs": runs, "prefill_p99_ms": p99,
           "prefill_over_quiet": p99 / q["p99_ms"] if q["p99_ms"] else None}
    progress(f"no offloading ({size} MiB prefilled beside the decoding request): p99 quiet "
             f"{q['p99_ms']:.1f} ms, after the prefill {p99:.1f} ms (median of "
             f"{PREFILL_RUNS}), {out['prefill_over_quiet']:.2f}x")
    return out


def store_over_no_offload(inter_token: dict[str, Any], reference: dict[str, Any] | None
                          ) -> float | None:
    """A plane's store-window p99 over its quiet p99 times the baseline's prefill ratio."""
    ratio = (reference or {}).get("prefill_over_quiet")
    store, quiet = inter_token["store"]["p99_ms"], inter_token["quiet"]["p99_ms"]
    if not ratio or store is None or not quiet:
        return None
    return store / (quiet * ratio)
