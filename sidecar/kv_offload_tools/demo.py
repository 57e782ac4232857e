"""`kv-offload demo`: sidecars and simulated vLLM engines sharing chunks on this host.

Starts N real ``kv-offload sidecar`` processes (a LocalPool) and N simulated
vLLM engines, one per pod, each with the kv-offload secondary tier. Replays
the Mooncake trace sample shipped in ``data/`` with round-robin routing: every
request hashes its tokens into vLLM's chunk keys, looks them up through the
tier, loads the hits (from its own sidecar or, through it, from a peer pod),
checks every loaded byte against the KV it would compute, and stores the rest.
Prints live progress, then a table per pod and in total. Exit code 1 when any
loaded byte differed; 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kv_offload_sidecar.settings import DEFAULT_HASH_SEED, TRANSPORTS
from kv_offload_sidecar.usage import UsageError

from kv_offload_testing import scrape
from kv_offload_testing.engine_sim import RequestResult, SimulatedEngine, trace_tokens
from kv_offload_testing.local_pool import LocalPool, SidecarOverride, example_config
from kv_offload_tools.mooncake_trace import TRACE_SAMPLE, load_trace
from kv_offload_tools.pod_table import PodCounts, format_table, total_of
from kv_offload_tools.progress import to_stderr


@dataclass
class PodReport(PodCounts):
    """What one pod (sidecar + simulated engine) did in the demo."""

    # Chunk keys the engine's tier looked up.
    lookups: int = 0
    # Loaded bytes that differed from the KV the engine computes (must be 0).
    mismatched_bytes: int = 0
    # Load jobs that failed in whole or part.
    failed_loads: int = 0
    # Seconds of each load job.
    load_seconds: list[float] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return (self.local_hits + self.peer_hits) / self.lookups if self.lookups else 0.0


@dataclass
class DemoReport:
    pods: list[PodReport]
    requests: int
    seconds: float

    @property
    def total(self) -> PodReport:
        return total_of(self.pods, PodReport)


def run_demo(pods: int = 3, requests: int | None = None, transport: str = "tcp",
             seconds: float = 90.0, trace: str | Path = TRACE_SAMPLE,
             progress=None, intruder: bool = False,
             launcher: Callable[[Sequence[str], Mapping[str, str]], list[str]] | None = None) -> DemoReport:
    """Run the demo; ``progress(line)`` receives live status lines.

    ``launcher`` is the pool's (``LocalPool``): how each sidecar process is started.

    ``intruder`` adds one more sidecar hashing prefixes with another seed: the
    pods must reject its handshakes (fail closed) and share nothing with it.
    """
    config = example_config(engine_id="kv-offload-demo")
    trace_ids = load_trace(trace)
    if requests is not None:
        trace_ids = trace_ids[:requests]
    start = time.monotonic()
    with LocalPool(pods, transport=transport, config=config, capacity_bytes=64 << 20,
                   publish_interval_seconds=0.1, launcher=launcher) as pool:
        if intruder:
            pool.add(SidecarOverride(hash_seed="4242"), wait_connected=False)
            if progress:
                progress("[demo] added an intruder sidecar with another hash seed; "
                         "the pods must reject it")
        engines = [SimulatedEngine(config, hash_seed=DEFAULT_HASH_SEED, host="127.0.0.1",
                                   port=pool[i].port, name=f"pod-{i}") for i in range(pods)]
        reports = [PodReport(f"pod-{i}", f"{pool[i].url}/metrics") for i in range(pods)]
        try:
            done = _replay(engines, reports, trace_ids, start + seconds, progress)
            for i, (engine, rep) in enumerate(zip(engines, reports)):
                st = engine.tier.stats
                rep.lookups, rep.local_hits, rep.peer_hits, rep.misses = (
                    st.lookups, st.local_hits, st.peer_hits, st.misses)
                rep.failed_loads = st.failed_loads
                rep.load_seconds = list(st.load_seconds)
                rep.read_sidecar(scrape.scrape(rep.metrics_url))
        finally:
            for engine in engines:
                engine.close()
    return DemoReport(reports, done, time.monotonic() - start)


def _replay(engines: list[SimulatedEngine], reports: list[PodReport], trace_ids: list[list[int]],
            deadline: float, progress) -> int:
    """Round-robin: request i goes to pod i % N; the N pods run their requests side by side."""
    n = len(engines)
    tpc = engines[0].layout.tokens_per_chunk
    lock = threading.Lock()
    errors: list[BaseException] = []
    last = [0.0]

    def one(pod: int, ids: list[int]) -> None:
        try:
            res: RequestResult = engines[pod].run_request(trace_tokens(ids, tpc))
        except BaseException as exc:  # surfaced after the batch
            with lock:
                errors.append(exc)
            return
        with lock:
            reports[pod].requests += 1
            reports[pod].mismatched_bytes += res.mismatched_bytes

    done = 0
    for first in range(0, len(trace_ids), n):
        if time.monotonic() > deadline:
            break
        batch = trace_ids[first:first + n]
        threads = [threading.Thread(target=one, args=(i, ids)) for i, ids in enumerate(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done += len(batch)
        now = time.monotonic()
        if progress and (now - last[0] >= 1.0 or done == len(trace_ids)):
            last[0] = now
            progress(_progress_line(engines, reports, done, len(trace_ids)))
    return done


def _progress_line(engines, reports, done: int, total: int) -> str:
    looked = sum(e.tier.stats.lookups for e in engines)
    local = sum(e.tier.stats.local_hits for e in engines)
    peer = sum(e.tier.stats.peer_hits for e in engines)
    bad = sum(r.mismatched_bytes for r in reports)
    ratio = (local + peer) / looked if looked else 0.0
    return (f"[demo] {done}/{total} requests  chunks looked up {looked}  "
            f"hit ratio {ratio:.2f} (local {local}, peer {peer})  mismatched bytes {bad}")


def _ms(values: Sequence[float], q: float) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * 1e3:.1f}"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"{cuts[int(q * 100) - 1] * 1e3:.1f}"


def format_report(report: DemoReport) -> str:
    head = ("pod", "requests", "lookups", "local hits", "peer hits", "misses", "hit ratio",
            "bytes moved", "fetch p50 ms", "fetch p99 ms", "rejections", "mismatched", "metrics")
    rows = []
    for p in [*report.pods, report.total]:
        rows.append((p.name, str(p.requests), str(p.lookups), str(p.local_hits),
                     str(p.peer_hits), str(p.misses), f"{p.hit_ratio:.3f}", _bytes(p.bytes_moved),
                     _ms(p.load_seconds, 0.50), _ms(p.load_seconds, 0.99),
                     str(p.handshake_rejections), str(p.mismatched_bytes), p.metrics_url))
    return format_table(head, rows)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=3, help="sidecars and engines (default 3)")
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                        help="sim: simulated vLLM engines (fast, the default); vllm: real vLLM "
                             "engines from .venv-vllm (./dev setup), a tiny random model")
    parser.add_argument("--requests", type=int, default=None,
                        help="replay at most this many trace requests (default: the whole sample)")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="tcp",
                        help="data plane between the sidecars (default tcp)")
    parser.add_argument("--seconds", type=float, default=90.0,
                        help="stop dispatching requests after this many seconds (default 90)")
    parser.add_argument("--trace", default=str(TRACE_SAMPLE),
                        help="Mooncake-format JSONL trace (default: the shipped sample)")
    parser.add_argument("--intruder", action=argparse.BooleanOptionalAction, default=True,
                        help="also start a sidecar with another hash seed, which the pods "
                             "reject, to show the fail-closed check (default on)")


def run(args: argparse.Namespace) -> int:
    if args.pods < 2:
        raise UsageError("kv-offload demo: --pods must be at least 2 so pods can share chunks")
    if args.requests is not None and args.requests < 1:
        raise UsageError("kv-offload demo: --requests must be at least 1")
    if args.seconds <= 0:
        raise UsageError("kv-offload demo: --seconds must be positive")
    if not os.path.exists(args.trace):
        raise UsageError(f"kv-offload demo: trace {args.trace!r} does not exist; pass --trace FILE")
    if args.transport == "ucx":
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")  # CPU-only host
    if args.engine == "vllm":
        return _run_vllm(args)
    to_stderr(f"[demo] starting {args.pods} sidecars ({args.transport}) and {args.pods} simulated "
              f"vLLM engines; trace {args.trace}")
    try:
        report = run_demo(args.pods, args.requests, args.transport, args.seconds, args.trace,
                          progress=to_stderr, intruder=args.intruder)
    except ValueError as exc:
        raise UsageError(f"kv-offload demo: {exc}") from None
    print(format_report(report))
    total = report.total
    print(f"\n{report.requests} requests in {report.seconds:.1f} s; hit ratio "
          f"{total.hit_ratio:.3f}, of which peer hits {total.peer_hits}; "
          f"mismatched bytes {total.mismatched_bytes}")
    return _verdict(total, "loaded chunks differ from the KV the engines compute"
                    if total.mismatched_bytes else "")


def _run_vllm(args: argparse.Namespace) -> int:
    """The demo with real vLLM engines (a tool outside the sidecar image)."""
    try:
        from kv_offload_tools.vllm_harness.deployment import VllmUnavailable
        from kv_offload_tools.vllm_harness.vllm_demo import (
            VllmPodReport,
            format_vllm_report,
            run_vllm_demo,
        )
    except ImportError as exc:
        raise UsageError(f"kv-offload demo --engine vllm needs the kv-offload tools ({exc}); "
                         "run it from a checkout with ./dev demo --engine vllm") from None
    try:
        trace_ids = load_trace(args.trace)[:args.requests or 30]
    except ValueError as exc:
        raise UsageError(f"kv-offload demo: {exc}") from None
    to_stderr(f"[demo] {args.pods} sidecars and {args.pods} real vLLM engines; "
              f"{len(trace_ids)} requests of {args.trace}")
    try:
        reports = run_vllm_demo(args.pods, trace_ids, intruder=args.intruder,
                                progress=to_stderr)
    except VllmUnavailable as exc:
        raise UsageError(f"kv-offload demo: {exc}") from None
    print(format_vllm_report(reports))
    total = total_of(reports, VllmPodReport)
    print(f"\n{total.requests} requests; vLLM reported {total.cached_tokens} of "
          f"{total.prompt_tokens} prompt tokens cached, {total.p2p_tokens} of them from peers; "
          f"outputs differing from an engine without offloading: {total.differing_outputs}")
    return _verdict(total, "an engine's output differs from one without offloading"
                    if total.differing_outputs else "")


def _verdict(total: PodCounts, failure: str) -> int:
    """The demo's exit code: 1 with ``failure`` said on stderr, else 0; first the note on lookups
    that gave up on a slow peer, if any did."""
    if total.given_up_note():
        print(total.given_up_note())
    if failure:
        print(f"kv-offload demo: FAILED: {failure}", file=sys.stderr)
        return 1
    return 0
