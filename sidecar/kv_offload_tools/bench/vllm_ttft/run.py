"""The run of `bench vllm`: references, the baseline engine, then per data plane a pool of two
sidecars and engines A and B (``measure``), returning the JSON report.

A plane's engines start side by side (``start_all``) on every core and are pinned to the
compute cores once ready (``pin_tree``: as if started there); the baseline and the store
window's reference engine with vLLM's CPU tier alone (``no_offload``) run first, one at a
time and started on the compute cores, or beside the first plane's idle engines when every
KV cache is small, and are closed before the planes' engines write any offloaded bytes. Each
row's memcpy and raw-TCP references are measured again just before the row (``reference``):
a target is a ratio to them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kv_offload_tools.bench.vllm_ttft.measure import PlaneBench, progress
from kv_offload_tools.bench.vllm_ttft.no_offload import (
    REFERENCES, prefill_reference, store_over_reference)
from kv_offload_tools.bench.vllm_ttft.plan import (
    BLOCK_TOKENS,
    CHUNK_TOKENS,
    GiB,
    WINDOW_RUNS,
    Plan,
    decode_prompt,
    itl_role,
    prefix_prompt,
    prompt,
    prompt_key,
)
from kv_offload_tools.bench.vllm_ttft.probes import thread_cores, tree_threads
from kv_offload_tools.bench.vllm_ttft.refs import memcpy_seconds, raw_tcp_seconds
from kv_offload_testing.local_pool import LocalPool
from kv_offload_tools.vllm_harness.deployment import CPU_SPEC, TIER_TYPE, VllmDeployment
from kv_offload_tools.vllm_harness.driver_client import close_all, start_all

# Tier keys of every engine: a 1 GiB load on a slow plane, or a lookup on a loaded host, must
# not time out into a recompute (the bench measures hits; a miss is reported as one).
TIER_KEYS = {"load_timeout_seconds": 60.0, "lookup_timeout_seconds": 10.0}
# The sidecars' peer-fetch deadline, for the same reason.
FETCH_DEADLINE_S = 60.0
# Tokens the decoding request's output is checked against the baseline's.
DECODE_CHECK_TOKENS = 8
# Start the baseline beside the first plane's engines only when each engine's KV cache is this
# small (GiB): the host's RAM is shared.
_OVERLAP_MAX_KV_GIB = 1


def _prompts(plan: Plan) -> dict[str, list[int]]:
    """Every prompt whose first token the baseline must give, by key."""
    out = {prompt_key(size): prefix_prompt(plan, size) for size in plan.sizes_mib}
    if plan.itl_size_mib:
        for what in ("load", "store"):
            for run in range(WINDOW_RUNS):
                role = itl_role(what, run)
                out[prompt_key(plan.itl_size_mib, role)] = prefix_prompt(plan, plan.itl_size_mib,
                                                                         role)
    return out


def _decode_prompts(plan: Plan) -> dict[str, list[int]]:
    if not plan.itl_size_mib:
        return {}
    return {f"decode/{what}": decode_prompt(what) for what in ("quiet", "load", "store")}


def _warm_prompt(plane: str) -> list[int]:
    return prompt(f"warm/{plane}", 2 * CHUNK_TOKENS + 1)


def reference(plan: Plan, size: int, where: str = "") -> dict[str, Any]:
    """memcpy and raw TCP of one prefix's bytes, now (on the calling thread's cores)."""
    nbytes = plan.prefix_bytes(size)
    mem, tcp = memcpy_seconds(nbytes), raw_tcp_seconds(nbytes)
    progress(f"{where}reference {size} MiB: memcpy {mem:.3f} s, raw TCP {tcp:.3f} s")
    return {"size_mib": size, "bytes": nbytes, "memcpy_s": mem, "raw_tcp_s": tcp,
            "memcpy_gbps": nbytes / 1e9 / mem, "raw_tcp_gbps": nbytes / 1e9 / tcp}


def _baseline(deployment: VllmDeployment, baseline: Any, plan: Plan
              ) -> tuple[dict[str, list[int]], list[dict[str, Any]]]:
    """The baseline's first tokens of every prompt (and first tokens of the decoding
    requests), and its TTFT per size (recompute without any offloading)."""
    expected: dict[str, list[int]] = {}
    ttfts: list[dict[str, Any]] = []
    baseline.generate([_warm_prompt("baseline")], max_tokens=1)
    for key, p in _prompts(plan).items():
        (out,) = baseline.generate([p], max_tokens=1)
        expected[key] = out["token_ids"]
        role, _, size = key.partition("/")
        if role == "prefix":
            ttfts.append({"size_mib": int(size), "ttft_s": baseline.last_generate_s})
    for key, p in _decode_prompts(plan).items():
        (out,) = baseline.generate([p], max_tokens=DECODE_CHECK_TOKENS)
        expected[key] = out["token_ids"]
    progress(f"baseline: first tokens of {len(expected)} prompts; recompute "
             + ", ".join(f"{t['size_mib']} MiB {t['ttft_s']:.3f} s" for t in ttfts))
    return expected, ttfts


def _store_references(plan: Plan, engines: dict[str, Any], report: dict[str, Any]) -> None:
    """The store window on the reference engines (``no_offload``), each closed after."""
    for which, engine in engines.items():
        try:
            report["store_references"][which] = prefill_reference(engine, plan, which)
        finally:
            engine.close()


T = TypeVar("T")


def split_cores(omp_bind: str) -> tuple[set[int], set[int]] | None:
    """(engine cores, sidecar cores): the engines run on the cores their compute is bound
    to, the sidecars and the references on the others; None for 'auto' or when no core is
    left over. vLLM's Python threads spin while a request waits (its engine core steps
    every ~2 ms, and its shared-memory queues busy-poll for a second before they sleep),
    so unpinned they take the sidecars' core on a small host, as they would not on a GPU
    node where the vLLM and sidecar containers have CPUs of their own."""
    if omp_bind == "auto" or not hasattr(os, "sched_getaffinity"):
        return None
    engine: set[int] = set()
    for part in omp_bind.replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        engine.update(range(int(lo), int(hi or lo) + 1))
    rest = os.sched_getaffinity(0) - engine
    return (engine, rest) if rest and engine <= os.sched_getaffinity(0) else None


@contextlib.contextmanager
def on_cores(cores: set[int] | None) -> Iterator[None]:
    """The calling thread (and the processes it starts) on ``cores`` meanwhile."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_tree(pid: int, cores: set[int] | None, started_on: set[int]) -> None:
    """Every thread of ``pid``'s process tree still on ``started_on`` (the cores it was
    started on) on ``cores`` from now on; threads they start later inherit it. A thread that
    chose its cores keeps them: vLLM's compute threads (VLLM_CPU_OMP_THREADS_BIND) and the
    CPU harness's copy threads (off the compute cores), so the engines end up as engines
    started on ``cores`` would. Engines start on every core, so that their imports (about
    20 s of CPU each here) spread over the cores while the sidecars beside them are still
    idle, and are pinned once ready, before anything is measured."""
    if not cores:
        return
    for tid in tree_threads(pid):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if os.sched_getaffinity(tid) == started_on:
                os.sched_setaffinity(tid, cores)


def pinned(cores: set[int] | None, start: Callable[[], T]) -> Callable[[], T]:
    """``start`` run on ``cores`` (for start_all's threads)."""
    def run() -> T:
        with on_cores(cores):
            return start()
    return run


def run_bench(plan: Plan, workdir: str, *, omp_bind: str, spec: str) -> dict[str, Any]:
    t0 = time.monotonic()
    deployment = VllmDeployment(
        workdir, model_name=f"kv-llama-{plan.layers}", model_config=plan.model_config,
        block_size=BLOCK_TOKENS, chunk_tokens=CHUNK_TOKENS, cpu_bytes=plan.primary_bytes,
        spec=CPU_SPEC if spec == CPU_SPEC["spec_name"] else {"spec_name": spec})
    config = deployment.config
    if config.kv_bytes_per_chunk != plan.chunk_bytes:
        raise RuntimeError(f"the translated config says {config.kv_bytes_per_chunk} bytes per "
                           f"chunk, the plan {plan.chunk_bytes}")
    # llm_kwargs carry kv_cache_memory_bytes: the engine driver then unsets the whole-GiB
    # VLLM_CPU_KVCACHE_SPACE (which would waste up to a GiB per engine of a shared host's RAM).
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind}
    llm_kwargs = plan.llm_kwargs()
    progress(f"model: {plan.layers} layers, {plan.bytes_per_token >> 10} KiB of KV per token, "
             f"{plan.chunk_bytes >> 20} MiB per chunk; engines: KV cache {plan.kv_cache_bytes >> 20} MiB, "
             f"primary tier {plan.primary_bytes >> 20} MiB, max_model_len {plan.max_model_len}; "
             f"sidecar stores {plan.store_bytes >> 20} MiB ({time.monotonic() - t0:.0f} s)")
    cores = split_cores(omp_bind)
    engine_cores, sidecar_cores = cores or (None, None)
    if cores:
        progress(f"engines on cores {sorted(cores[0])}, sidecars and references on {sorted(cores[1])}")
    with on_cores(sidecar_cores):
        refs = [reference(plan, size) for size in plan.sizes_mib]
    report: dict[str, Any] = {
        "config": {"sizes_mib": list(plan.sizes_mib), "planes": list(plan.planes),
                   "layers": plan.layers, "model": plan.model_config,
                   "kv_bytes_per_token": plan.bytes_per_token, "chunk_tokens": CHUNK_TOKENS,
                   "chunk_bytes": plan.chunk_bytes, "block_tokens": BLOCK_TOKENS,
                   "kv_cache_bytes": plan.kv_cache_bytes, "primary_bytes": plan.primary_bytes,
                   "store_bytes": plan.store_bytes, "max_model_len": plan.max_model_len,
                   "omp_bind": omp_bind, "spec": spec, "itl_size_mib": plan.itl_size_mib,
                   "max_decode_tokens": plan.max_decode_tokens, "tier_keys": TIER_KEYS},
        "cores": {"engines": sorted(cores[0]), "sidecars": sorted(cores[1])} if cores else None,
        "references": refs, "rows": [], "inter_token": [], "mismatches": [],
        "planes": {},
    }
    overlap = plan.kv_cache_bytes <= _OVERLAP_MAX_KV_GIB * GiB
    expected: dict[str, list[int]] | None = None
    report["store_references"] = {}
    if not overlap:
        baseline = pinned(engine_cores, lambda: deployment.start_baseline(
            extra_env=env, llm_kwargs=llm_kwargs))()
        try:
            expected, report["baseline"] = _baseline(deployment, baseline, plan)
            report["vllm_version"] = baseline.ready.get("vllm_version") if baseline.ready else None
        except BaseException:
            baseline.close()
            raise
        if not plan.itl_size_mib:
            baseline.close()
        else:  # one engine at a time: the host's RAM is shared
            _store_references(plan, {"no_connector": baseline}, report)
            cpu_only = pinned(engine_cores, lambda: deployment.start_cpu_tier_only(
                extra_env=env, llm_kwargs=llm_kwargs))()
            _store_references(plan, {"cpu_tier_only": cpu_only}, report)
    report["errors"] = []
    for plane in plan.planes:
        try:
            expected = _run_plane(plan, plane, deployment, env, llm_kwargs, expected, report,
                                  cores)
        except Exception as exc:  # the other planes still run; the error is reported
            if expected is None:
                raise
            progress(f"{plane}: FAILED: {exc!r}")
            report["errors"].append({"plane": plane, "error": repr(exc)})
    return report


def _run_plane(plan: Plan, plane: str, deployment: VllmDeployment, env: dict[str, str],
               llm_kwargs: dict[str, int], expected: dict[str, list[int]] | None,
               report: dict[str, Any],
               cores: tuple[set[int], set[int]] | None) -> dict[str, list[int]]:
    """One plane's pool and engines A and B, measured into ``report``; returns the
    baseline's first tokens (computed here when the baseline starts beside A and B)."""
    config = deployment.config
    t_plane = time.monotonic()
    engine_cores, sidecar_cores = cores or (None, None)
    with on_cores(sidecar_cores):
        pool = LocalPool(2, transport=plane, config=config, capacity_bytes=plan.store_bytes,
                         publish_interval_seconds=0.05, fetch_deadline_seconds=FETCH_DEADLINE_S,
                         model_identity=None,  # the engines state it
                         declared_identity=deployment.declared_identity)
        pool.__enter__()
    try:
        starters = [
            lambda: deployment.start_engine(f"a-{plane}", pool[0].port, tier_keys=TIER_KEYS,
                                            extra_env=env, llm_kwargs=llm_kwargs),
            lambda: deployment.start_engine(f"b-{plane}", pool[1].port, tier_keys=TIER_KEYS,
                                            extra_env=env, llm_kwargs=llm_kwargs)]
        if expected is None:
            starters.append(lambda: deployment.start_baseline(extra_env=env,
                                                              llm_kwargs=llm_kwargs))
            if plan.itl_size_mib:
                starters.append(lambda: deployment.start_cpu_tier_only(extra_env=env,
                                                                       llm_kwargs=llm_kwargs))
        started_on = os.sched_getaffinity(0)
        engines = start_all(starters)
        for engine in engines:
            pin_tree(engine.pid, engine_cores, started_on)
        bench: PlaneBench | None = None
        try:
            pool.wait_connected(120)  # the sidecars share once their engines attached
            a, b = engines[0], engines[1]
            if expected is None:
                expected, report["baseline"] = _baseline(deployment, engines[2], plan)
                report["vllm_version"] = engines[2].ready.get("vllm_version")
                if plan.itl_size_mib:
                    _store_references(plan, dict(zip(REFERENCES, engines[2:])), report)
                else:
                    engines[2].close()
            progress(f"{plane}: sidecars and engines up ({time.monotonic() - t_plane:.0f} s)")
            bench = PlaneBench(plan, plane, pool, a, b, expected, f"1:{TIER_TYPE}",
                               config.host_chunk_stride_bytes)
            bench.warm(_warm_prompt(plane))
            for size in plan.sizes_mib:
                # The row's own references, moments before it: the host's speed drifts by
                # tens of percent within a run, and each target is a ratio to them.
                with on_cores(sidecar_cores):
                    ref = reference(plan, size, f"{plane}: ")
                row = bench.measure_size(size)
                row["reference"] = ref
                report["rows"].append(row)
            if plan.itl_size_mib:
                itl = bench.inter_token(plan.itl_size_mib)
                for which in REFERENCES:
                    itl["store"][f"p99_over_{which}"] = store_over_reference(
                        itl, report["store_references"].get(which))
                report["inter_token"].append(itl)
            report["planes"][plane] = {"pids": bench.pids, "busy_neighbour": bench.busy_neighbour,
                                       # How many threads of A's and B's trees may run on
                                       # each set of cores (``pin_tree``).
                                       "engine_threads": {"a": thread_cores(a.pid),
                                                          "b": thread_cores(b.pid)},
                                       "seconds": round(time.monotonic() - t_plane, 1)}
        finally:
            if bench is not None:
                report["mismatches"] += bench.mismatches
            close_all(engines)
    finally:
        pool.__exit__(None, None, None)
    return expected
