"""The ``decode_latency`` op of ``engine_driver``: one request's inter-token times while
another request's prefix moves through offloading (runs in vLLM's python).

The driver steps vLLM's ``LLMEngine`` itself (``add_request`` / ``step``) and
timestamps every token of a decoding request D as it reaches this process, the
way a streaming client sees it. After D has ``warm_tokens`` tokens, a traffic
request T (``max_tokens=1``) is added: a prefix a peer holds (a load), a new
prefix this engine computes and then stores, or none (the quiet reference).
D's window ends on a state, then D is aborted (``window_end`` says which):

- ``traffic_finished``: T has its token (a load: every loaded chunk is in vLLM's rows);
- ``tokens_after_traffic``: with ``tokens_after_traffic`` (and no ``until_counter``), D has
  decoded that many tokens after T's token: the steps after a prefill on an engine without
  offloading, the reference of a store window;
- ``stored``: with ``until_counter``, T has finished and the engine's own vLLM counter
  (e.g. the tier's ``vllm:kv_offload_tiering_write_bytes``, which vLLM records as this
  process steps the engine) has grown by ``at_least`` since T was added: the store cascade
  runs after T's prefill and has landed;
- ``quiet_tokens``: without T, D has decoded ``quiet_tokens`` tokens after the mark;
- ``store_bound``: the counter did not grow enough within ``store_bound_s(at_least)``
  after T finished (a safety bound from the bytes, not a measurement);
- ``decode_finished``: D reached ``max_decode_tokens`` first.

The step that ran T's prompt tokens is compute, not offload traffic: the
interval of D that ends in the step delivering T's output is reported apart
(``compute_interval_index``); with ``max_num_batched_tokens`` at least T's
length vLLM prefills T in that one step.

Request and reply (``engine_driver`` documents the protocol)::

    {"op": "decode_latency", "decode_prompt": [ids], "traffic_prompt": [ids] | null,
     "warm_tokens": 8, "quiet_tokens": 32, "max_decode_tokens": 1024, "timeout_s": 120,
     "until_counter": {"name": str, "labels": {...}, "at_least": float} | null,
     "tokens_after_traffic": int | null}
    -> {"intervals_s": [...], "token_times_s": [...], "compute_interval_index": int | null,
        "decode_token_ids": [...], "traffic": {"token_ids", "num_cached_tokens",
        "added_at_s", "finished_at_s"} | null, "window_start_s", "window_end",
        "counter_growth", "counter_reached_at_s", "decode_finished", "elapsed_s"}

``intervals_s[i]`` is the time between D's token i+1 and token i+2 (the first
token, D's own prefill, is not an interval); times are seconds from D's add.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

__all__ = ["decode_latency", "store_bound_s"]

# The safety bound of a store window: a store slower than this, or not landed this many
# seconds after its request, is broken rather than slow (stores here run at 0.3-6 GB/s).
_SLOWEST_STORE_BYTES_PER_S = 10e6
_STORE_BOUND_FLOOR_S = 10.0


def store_bound_s(nbytes: float) -> float:
    """Seconds after T finished that D keeps decoding at most, waiting for ``nbytes`` to land."""
    return _STORE_BOUND_FLOOR_S + nbytes / _SLOWEST_STORE_BYTES_PER_S


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(ids: list[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[int(t) for t in ids])


def _counter(name: str, labels: Mapping[str, str], registry: Any = None) -> float:
    """Sum of this process's Prometheus samples ``name`` (or ``name_total``) with ``labels``.

    Read once per step of a store window, so only the collectors registered under that name
    are collected: collecting all of vLLM's metrics took about 1 ms here, on the engines'
    core, in store windows alone (their references end on a token count, read nothing)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry

    names = {name, f"{name}_total", name.removesuffix("_total")}
    by_name = getattr(registry, "_names_to_collectors", None)  # prometheus_client's own index
    collectors = {by_name[n] for n in names if n in by_name} if by_name is not None else set()
    metrics = ([m for c in collectors for m in c.collect()] if collectors
               else registry.collect())
    want = set(labels.items())
    return float(sum(s.value for metric in metrics if metric.name in names
                     for s in metric.samples if s.name in (name, f"{name}_total")
                     and want <= set(s.labels.items())))


def decode_latency(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Run the op on ``llm`` (a ``vllm.LLM`` with no request in flight)."""
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("decode_latency needs an idle engine")
    warm = int(cmd.get("warm_tokens", 8))
    quiet_tokens = int(cmd.get("quiet_tokens", 32))
    max_decode = int(cmd.get("max_decode_tokens", 1024))
    timeout_s = float(cmd.get("timeout_s", 120.0))
    traffic_prompt = cmd.get("traffic_prompt")
    until = cmd.get("until_counter")
    after = cmd.get("tokens_after_traffic")
    stamp = f"{time.monotonic_ns()}"
    decode_id, traffic_id = f"itl-decode-{stamp}", f"itl-traffic-{stamp}"

    t0 = time.monotonic()
    engine.add_request(decode_id, _prompt(cmd["decode_prompt"]), _params(max_decode))
    token_times: list[float] = []
    decode_tokens: list[int] = []
    traffic: dict[str, Any] | None = None
    traffic_added = traffic_done = None
    counter_start = growth = reached_at = None
    compute_index: int | None = None
    quiet_mark: float | None = None  # without traffic: when T would have been added
    quiet_from = 0  # D's tokens at the quiet mark
    done_from = 0  # D's tokens when T finished
    decode_finished = False
    end: str | None = None
    while end is None:
        if time.monotonic() - t0 > timeout_s:
            engine.abort_request([decode_id, traffic_id])
            raise TimeoutError(f"decode_latency: no end within {timeout_s} s")
        outputs = engine.step()
        now = time.monotonic() - t0
        traffic_finished_now = False
        for out in outputs:
            if out.request_id == traffic_id and out.finished:
                traffic_done = now
                traffic_finished_now = True
                traffic = {"token_ids": list(out.outputs[0].token_ids),
                           "num_cached_tokens": out.num_cached_tokens,
                           "added_at_s": round(traffic_added or 0.0, 6),
                           "finished_at_s": round(now, 6)}
        for out in outputs:
            if out.request_id != decode_id:
                continue
            ids = list(out.outputs[0].token_ids)
            for _ in range(len(ids) - len(decode_tokens)):
                token_times.append(now)
            decode_tokens = ids
            if traffic_finished_now and len(token_times) >= 2:
                compute_index = len(token_times) - 2
            if traffic_finished_now:
                done_from = len(token_times)
            decode_finished = decode_finished or out.finished
        if len(token_times) >= warm:
            if traffic_prompt is not None and traffic_added is None:
                if until is not None:
                    counter_start = _counter(until["name"], until.get("labels", {}))
                engine.add_request(traffic_id, _prompt(traffic_prompt), _params(1))
                traffic_added = time.monotonic() - t0
            elif traffic_prompt is None and quiet_mark is None:
                quiet_mark, quiet_from = now, len(token_times)
        if traffic_prompt is None:
            if quiet_mark is not None and len(token_times) - quiet_from >= quiet_tokens:
                end = "quiet_tokens"
        elif traffic_done is not None:
            if until is None and after is not None:
                if len(token_times) - done_from >= int(after):
                    end = "tokens_after_traffic"
            elif until is None:
                end = "traffic_finished"
            else:  # read only once T is done: the store cascade starts after its prefill
                growth = _counter(until["name"], until.get("labels", {})) - counter_start
                if growth >= float(until["at_least"]):
                    end, reached_at = "stored", now
                elif now - traffic_done > store_bound_s(float(until["at_least"])):
                    end = "store_bound"
        if end is None and decode_finished:
            end = "decode_finished"  # D reached max_decode_tokens: the window ends with it
    engine.abort_request([decode_id])
    # Drain what the abort leaves so the engine is idle for the next op.
    deadline = time.monotonic() + 10.0
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    intervals = [b - a for a, b in zip(token_times, token_times[1:])]
    return {
        "intervals_s": [round(x, 6) for x in intervals],
        "token_times_s": [round(x, 6) for x in token_times],
        "compute_interval_index": compute_index,
        "decode_token_ids": decode_tokens,
        "traffic": traffic,
        "decode_finished": decode_finished,
        "window_start_s": round(traffic_added if traffic_added is not None else (quiet_mark or 0.0), 6),
        "window_end": end,
        "counter_growth": growth,
        "counter_reached_at_s": None if reached_at is None else round(reached_at, 6),
        "elapsed_s": round(time.monotonic() - t0, 4),
    }
