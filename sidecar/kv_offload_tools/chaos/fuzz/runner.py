"""The fuzz run: every target's cases against one live sidecar, its health and memory watched.

``start_fuzz_sidecar`` adds the sidecar under test to a pool, stores the held
chunks and opens a peer session; ``run_target`` runs one target's hypothesis
cases (checking every 100 cases that the process lives, answers ``/healthz``,
and sampling its RSS; after the target, that no reservation outlived its
connection); ``run_fuzz`` warms every target up, then spreads the run's cases
over the targets by weight.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings

from kv_offload_tools.chaos.chunks import store_chunks
from kv_offload_tools.chaos.fuzz.context import (
    FuzzContext,
    FuzzFailure,
    Http,
    held_keys,
)
from kv_offload_tools.chaos.fuzz.control_targets import (
    handshake_cases,
    lookup_cases,
    run_handshake_case,
    run_lookup_case,
)
from kv_offload_tools.chaos.fuzz.data_targets import (
    data_streams,
    preauth_streams,
    run_data_case,
    run_preauth_case,
)
from kv_offload_tools.chaos.fuzz.directory_targets import (
    directory_cases,
    directory_session_cases,
    run_directory_case,
    run_directory_session_case,
)
from kv_offload_tools.chaos.fuzz.local_targets import local_cases, run_local_case
from kv_offload_tools.chaos.probes import probe_handshake
from kv_offload_testing.local_pool import LocalPool

# Bytes of one chunk in the fuzz pool (small: fuzzing moves many).
FUZZ_CHUNK_BYTES = 4096
# Default bound on RSS growth across a run (bytes).
DEFAULT_RSS_BOUND = 64 << 20


@dataclass
class TargetStats:
    """Outcomes of one target."""

    # Target name.
    target: str
    # Cases sent.
    cases: int = 0
    # Cases answered correctly.
    answers: int = 0
    # Cases refused with a clear error.
    errors: int = 0
    # Cases where the input was incomplete and the fuzzer hung up (the sidecar waited for more).
    incomplete: int = 0
    # Failures (wrong answer, 5xx, hang, crash); must be 0.
    failures: int = 0
    # First failure, for the report.
    first_failure: str = ""
    # Wall-clock seconds of the target.
    seconds: float = 0.0


@dataclass
class FuzzResult:
    """The figures of one fuzz run."""

    # Per-target outcomes.
    targets: list[TargetStats] = field(default_factory=list)
    # RSS of the sidecar after warm-up and at the end, and the highest seen (bytes).
    rss_start_bytes: int = 0
    rss_end_bytes: int = 0
    rss_peak_bytes: int = 0
    # Allowed growth (bytes).
    rss_bound_bytes: int = DEFAULT_RSS_BOUND
    # Times the sidecar process died (must be 0).
    crashes: int = 0
    # Times /healthz did not answer within REPLY_TIMEOUT (must be 0).
    hangs: int = 0
    # Wall-clock seconds.
    seconds: float = 0.0
    # RSS samples (case number, bytes) for the plot.
    rss_series: list[tuple[int, int]] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return sum(t.cases for t in self.targets)

    @property
    def failures(self) -> int:
        return sum(t.failures for t in self.targets)

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_end_bytes - self.rss_start_bytes

    @property
    def ok(self) -> bool:
        return (self.failures == 0 and self.crashes == 0 and self.hangs == 0
                and self.rss_growth_bytes <= self.rss_bound_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("rss_series")
        d.update(cases=self.cases, failures=self.failures, rss_growth_bytes=self.rss_growth_bytes,
                 ok=self.ok)
        return d



@dataclass(frozen=True)
class FuzzTarget:
    """One kind of message: its cases and how to send and judge one."""

    # Name in the report.
    name: str
    # Hypothesis strategy of one case.
    strategy: Any
    # Sends one case; returns "answer", "error" or "incomplete"; raises FuzzFailure.
    run: Callable[[FuzzContext, Any], str]
    # Share of the run's cases.
    weight: float


TARGETS = (
    FuzzTarget("handshake", handshake_cases(), run_handshake_case, 0.18),
    FuzzTarget("directory", directory_cases, run_directory_case, 0.08),
    FuzzTarget("directory_session", directory_session_cases, run_directory_session_case, 0.05),
    FuzzTarget("lookup", lookup_cases, run_lookup_case, 0.17),
    FuzzTarget("local", local_cases, run_local_case, 0.2),
    FuzzTarget("data_preauth", preauth_streams, run_preauth_case, 0.12),
    FuzzTarget("data_frames", data_streams, run_data_case, 0.2),
)



def start_fuzz_sidecar(pool: LocalPool) -> FuzzContext:
    """Start the sidecar under test, give it the held chunks and a peer session."""
    sc = pool.add(identity="fuzzed", peers=[])
    engine = sc.client()
    try:
        keys = held_keys()
        if store_chunks(engine, keys, pool.chunk_bytes) != len(keys):
            raise RuntimeError("could not store the fuzz pool's held chunks")
        socket_path = engine.socket_path
        num_slots = engine.num_slots
    finally:
        engine.close()
    wait_published(sc, len(keys))
    status = sc.status()
    probe = probe_handshake(sc, pool.pool_key, pool.local_hello(identity="fuzz-peer"))
    code, refused = sc.post("/v1/lookup", {"keys": [held_keys()[0].hex()]}, auth=False)
    if code != 401:
        raise RuntimeError(f"a lookup without the admin token was answered with HTTP {code}: {refused!r}")
    return FuzzContext(pool, sc, Http(sc.address), socket_path, status["data_address"],
                       probe.session, num_slots, unauthenticated_lookup_answer=refused)


def wait_published(sc: Any, chunks: int, timeout: float = 10.0) -> None:
    """Until the sidecar's directory names it for the ``chunks`` it holds (it owns every bucket)."""
    deadline = time.monotonic() + timeout
    while True:
        location = sc.status()["location"]
        if location["pending"] == 0 and location["entries"] >= chunks:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fuzzed sidecar did not publish its chunks: {location}")
        time.sleep(0.05)


def check_alive(ctx: FuzzContext, result: FuzzResult) -> None:
    """The process runs and answers /healthz in time; raises FuzzFailure otherwise."""
    if not ctx.sidecar.alive():
        result.crashes += 1
        raise FuzzFailure(f"the sidecar died: {ctx.sidecar.log_tail()}")
    probe = Http(ctx.sidecar.address)
    try:
        status, _ = probe.request("GET", "/healthz")
    except OSError as exc:
        result.hangs += 1
        raise FuzzFailure(f"/healthz did not answer: {exc}") from None
    finally:
        probe.close()
    if status != 200:
        result.hangs += 1
        raise FuzzFailure(f"/healthz answered {status}")


def check_store_consistent(ctx: FuzzContext) -> None:
    """No reservation outlived its connection: slots in use == visible chunks."""
    for _ in range(50):
        store = ctx.sidecar.status()["store"]
        if store["used_bytes"] == store["chunks"] * store["slot_stride"]:
            return
        time.sleep(0.02)
    raise FuzzFailure(f"store has slots in use beyond its visible chunks: {store}")


def run_target(ctx: FuzzContext, target: FuzzTarget, examples: int, result: FuzzResult,
               *, seed: int | None = None, raise_failures: bool = True,
               progress: Callable[[str], None] | None = None) -> TargetStats:
    """Run ``examples`` hypothesis cases of one target against the live sidecar."""
    stats = TargetStats(target.name)
    result.targets.append(stats)
    started = time.monotonic()
    case_index = [0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink] if raise_failures else [Phase.generate],
              report_multiple_bugs=False)
    @given(target.strategy)
    def case(value: Any) -> None:
        stats.cases += 1
        case_index[0] += 1
        try:
            try:
                outcome = target.run(ctx, value)
            except FuzzFailure:
                raise
            except Exception as exc:  # a reset, a reply the decoders refuse, ...
                raise FuzzFailure(f"{target.name}: {type(exc).__name__}: {exc}") from exc
        except FuzzFailure as exc:
            stats.failures += 1
            if raise_failures:
                raise
            # The bench counts every failure and goes on; the first is kept for the report.
            stats.first_failure = stats.first_failure or f"{exc} (case {value!r})"[:600]
            return
        stats.answers += outcome == "answer"
        stats.errors += outcome == "error"
        stats.incomplete += outcome == "incomplete"
        if case_index[0] % 100 == 0:
            check_alive(ctx, result)
            rss = ctx.sidecar.rss_bytes()
            result.rss_peak_bytes = max(result.rss_peak_bytes, rss)
            result.rss_series.append((sum(t.cases for t in result.targets), rss))
        if progress and case_index[0] % 500 == 0:
            progress(f"fuzz {target.name}: {stats.cases} cases, {stats.failures} failures")

    try:
        case()
        check_alive(ctx, result)
        check_store_consistent(ctx)
    except Exception as exc:  # FuzzFailure, or hypothesis' own report of one (e.g. FlakyFailure)
        stats.first_failure = stats.first_failure or f"{type(exc).__name__}: {exc}"[:600]
        stats.failures = max(stats.failures, 1)
        if raise_failures:
            raise
    ctx.http.close()
    stats.seconds = round(time.monotonic() - started, 2)
    return stats


def run_fuzz(pool: LocalPool, total_cases: int, *, rss_bound_bytes: int = DEFAULT_RSS_BOUND,
             progress: Callable[[str], None] | None = None, raise_failures: bool = False) -> FuzzResult:
    """Fuzz every target of a fresh sidecar of ``pool`` with about ``total_cases`` cases."""
    started = time.monotonic()
    result = FuzzResult(rss_bound_bytes=rss_bound_bytes)
    ctx = start_fuzz_sidecar(pool)
    warm = FuzzResult()
    for target in TARGETS:  # warm-up: import paths, caches, allocator arenas
        run_target(ctx, target, 20, warm, raise_failures=raise_failures)
    result.rss_start_bytes = result.rss_peak_bytes = ctx.sidecar.rss_bytes()
    for target in TARGETS:
        n = max(1, round(total_cases * target.weight))
        run_target(ctx, target, n, result, raise_failures=raise_failures, progress=progress)
    with contextlib.suppress(OSError):
        result.rss_end_bytes = ctx.sidecar.rss_bytes()
    result.rss_peak_bytes = max(result.rss_peak_bytes, result.rss_end_bytes)
    result.seconds = round(time.monotonic() - started, 2)
    return result
