"""The store window's references: the same window on an engine without the kv-offload tier.

A store window holds more than the tier's traffic: it starts with the traffic request's
prefill, then vLLM stores the prefix in its own primary CPU tier (on this host the CPU
harness's copy threads inside the engine process, where a GPU copies by DMA), and only then
does the tier hand the chunks to its sidecar. The decoding request's steps right after the
prefill ran at up to 2.4x its quiet p99 with vLLM's CPU tier alone and no kv-offload tier,
and at up to 1.4x with no connector at all. So the same window is measured on two engines
beside the planes' (``REFERENCES``): the baseline (no connector) and one with vLLM's
offloading and its primary CPU tier but no secondary tier. Each decodes the request beside
``WINDOW_RUNS`` fresh prefixes of the store window's size, for ``AFTER_PREFILL_TOKENS``
tokens after each prefix's first token.

Those engines run before the planes (or beside the first plane's idle engines), when the
host may run faster or slower; so what is carried over is a ratio of that sitting,
``prefill_over_quiet``: the median over the windows of each window's p99, over the same
engine's quiet p99 (two quiet runs pooled, as on the planes). A plane's store window is then
measured against its own quiet p99 times that ratio (``store_over_reference``)."""

from __future__ import annotations

import statistics
from typing import Any

from kv_offload_tools.bench.vllm_ttft.figures import itl_stats, itl_window
from kv_offload_tools.bench.vllm_ttft.measure import QUIET_TOKENS, WARM_TOKENS, progress
from kv_offload_tools.bench.vllm_ttft.plan import (
    WINDOW_RUNS, Plan, decode_prompt, itl_role, prefix_prompt)

__all__ = ["AFTER_PREFILL_TOKENS", "REFERENCES", "prefill_reference",
           "store_over_reference"]

# Tokens D decodes after the prefilled prefix's first token: about what a 512 MiB store
# window holds here before its bytes land (15-25 intervals).
AFTER_PREFILL_TOKENS = 20
# The reference engines, by the report key under ``store_references``: what each lacks.
REFERENCES = {"no_connector": "no offloading at all",
              "cpu_tier_only": "vLLM's own CPU tier alone, no kv-offload tier"}


def prefill_reference(engine: Any, plan: Plan, which: str) -> dict[str, Any]:
    """Quiet and prefill-beside windows of ``engine``, and their p99 ratio."""
    size = plan.itl_size_mib
    kwargs = {"warm_tokens": WARM_TOKENS, "quiet_tokens": QUIET_TOKENS,
              "max_decode_tokens": plan.max_decode_tokens}
    quiet = [engine.decode_latency(decode_prompt("quiet"), None, **kwargs) for _ in range(2)]
    prefill = [engine.decode_latency(decode_prompt("store"),
                                     prefix_prompt(plan, size, itl_role("reference", i)),
                                     tokens_after_traffic=AFTER_PREFILL_TOKENS, **kwargs)
               for i in range(WINDOW_RUNS)]
    ended = {r["window_end"] for r in prefill}
    if ended != {"tokens_after_traffic"}:
        raise RuntimeError(f"a {which} prefill window ended on {sorted(ended)}, not after "
                           f"{AFTER_PREFILL_TOKENS} tokens: raise --max-decode-tokens")
    q = itl_stats([iv for r in quiet for iv in itl_window(r)])
    runs = [itl_stats(itl_window(r), with_intervals=True) for r in prefill]
    p99 = statistics.median(r["p99_ms"] for r in runs)
    ratio = p99 / q["p99_ms"] if q["p99_ms"] else None
    progress(f"{REFERENCES[which]} ({size} MiB prefilled beside the decoding request): p99 "
             f"quiet {q['p99_ms']:.1f} ms, after the prefill {p99:.1f} ms (median of "
             f"{WINDOW_RUNS}), {ratio or 0:.2f}x")
    return {"engine": REFERENCES[which], "size_mib": size, "quiet": q, "prefill_runs": runs,
            "prefill_p99_ms": p99, "prefill_over_quiet": ratio}


def store_over_reference(inter_token: dict[str, Any], reference: dict[str, Any] | None
                         ) -> float | None:
    """A plane's store-window p99 over its quiet p99 times a reference engine's prefill ratio."""
    ratio = (reference or {}).get("prefill_over_quiet")
    store, quiet = inter_token["store"]["p99_ms"], inter_token["quiet"]["p99_ms"]
    if not ratio or store is None or not quiet:
        return None
    return store / (quiet * ratio)
