"""What every attack of ``kv-offload bench attack`` gets, and what it reports.

``AttackContext``: the pool, the member under attack (``target``: the holder the
honest load fetches from), its control port, data address and local-channel
socket, the attackers' source addresses, the watch and the honest load.
``measured(ctx, name, port)`` wraps one attack: it snapshots the target's
counters, log bytes and tracebacks before and after, and fills an
``AttackResult`` with what moved, the target's peak RSS and descriptors in the
attack's window and the honest load's figures in that window.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_offload_tools.bench.attack.honest import HonestLoad
from kv_offload_tools.bench.attack.pool import PoolWatch, counter_deltas, counters, cpu_seconds
from kv_offload_testing.local_pool import LocalPool
from kv_offload_testing.sidecar_process import SidecarProcess

Progress = Callable[[str], None]


@dataclass
class AttackResult:
    """What the sidecar did to one attack class."""

    name: str
    # "control", "data", "local" or "pool" (a foreign sidecar).
    port: str
    # Connections or requests sent.
    sent: int = 0
    # What came back -> how often ("HTTP 400", "AUTH_CHALLENGE+ERROR(oversize) + close", ...).
    answers: dict[str, int] = field(default_factory=dict)
    # Connections the sidecar closed by itself (held classes), and the median seconds to it.
    cut: int | None = None
    cut_median_seconds: float | None = None
    # Responses with status 500 (and any other 5xx).
    http_500: int = 0
    http_5xx_other: int = 0
    # The target's kv_offload_*_total counters that moved (name{labels} -> delta).
    counters: dict[str, float] = field(default_factory=dict)
    # Bytes every member's log grew by, and tracebacks logged, during the attack.
    log_bytes: int = 0
    tracebacks: int = 0
    # The target's RSS growth (bytes) and descriptors at the attack's peak, over its value before.
    rss_peak_growth: int = 0
    fds_peak_growth: int = 0
    # CPU seconds used in the window: by the target, by the other members, by the bench's own
    # process (the attackers' threads; the honest engines run in a process of their own).
    target_cpu_seconds: float = 0.0
    members_cpu_seconds: float = 0.0
    attackers_cpu_seconds: float = 0.0
    # Monotonic window of the attack.
    started: float = 0.0
    ended: float = 0.0
    # The honest load's figures in the window.
    honest: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def answer(self, word: str, status: int | None = None) -> None:
        self.answers[word] = self.answers.get(word, 0) + 1
        if status == 500:
            self.http_500 += 1
        elif status is not None and status >= 500:
            self.http_5xx_other += 1

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def to_dict(self, t0: float) -> dict[str, Any]:
        d = asdict(self)
        d["started"] = round(self.started - t0, 2)
        d["ended"] = round(self.ended - t0, 2)
        return d


@dataclass
class AttackContext:
    pool: LocalPool
    target: SidecarProcess
    data_address: str
    local_socket: str
    sources: list[str]
    watch: PoolWatch
    honest: HonestLoad
    progress: Progress
    # Times each one-shot probe is sent.
    repeats: int = 20
    # Rejected step-1 handshakes of the rejection flood.
    rejected_handshakes: int = 200
    # Monotonic time after which the one-shot attacks send nothing more (the run's budget).
    deadline: float = float("inf")
    results: list[AttackResult] = field(default_factory=list)
    # Server headers the control port sent (what it tells about itself).
    server_headers: set[str] = field(default_factory=set)
    # Hostile connections the siege opened.
    siege_connections: int = 0
    # What the pool's own callers got while the siege held everything (what -> answer).
    during_siege: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.target.host

    @property
    def port(self) -> int:
        return self.target.port

    def rounds(self, n: int, result: AttackResult) -> Iterator[int]:
        """0 .. n-1 while the run's time budget lasts (noted on ``result`` when it ran out)."""
        for i in range(n):
            if time.monotonic() > self.deadline:
                result.note(f"stopped after {i} of {n} rounds: the run's time budget ran out")
                return
            yield i

    def source(self, i: int) -> str:
        return self.sources[i % len(self.sources)]

    def target_counters(self) -> dict[str, float] | None:
        try:
            return counters(self.target.metrics())
        except (OSError, ValueError) as exc:
            self.progress(f"  /metrics of {self.target.identity} unreadable: {type(exc).__name__}")
            return None

    def log_bytes(self) -> int:
        return sum(s.members[sc.identity][2] for s in [self.watch.sample()] for sc in self.watch.members)

    def cpu(self) -> tuple[float, float, float]:
        """CPU seconds so far of the target, of the other members, and of this process."""
        others = sum(cpu_seconds(sc.proc.pid) for sc in self.watch.members  # type: ignore[union-attr]
                     if sc is not self.target and sc.proc is not None)
        return cpu_seconds(self.target.proc.pid), others, time.process_time()  # type: ignore[union-attr]

    def traceback_count(self) -> int:
        return sum(len(v) for v in self.watch.tracebacks().values())


@contextlib.contextmanager
def measured(ctx: AttackContext, name: str, port: str) -> Iterator[AttackResult]:
    """Run the body as attack ``name``; its result gets the window's figures and is kept."""
    result = AttackResult(name, port)
    ctx.progress(f"attack {name} ({port} port of {ctx.target.identity})")
    before = ctx.target_counters()
    logs0, tb0 = ctx.log_bytes(), ctx.traceback_count()
    base = ctx.watch.sample().members[ctx.target.identity]
    cpu0 = ctx.cpu()
    result.started = time.monotonic()
    try:
        yield result
    finally:
        after = ctx.target_counters()
        if before is not None and after is not None:
            result.counters = counter_deltas(before, after)
        else:
            result.note("counters not read: /metrics did not answer")
        result.log_bytes = ctx.log_bytes() - logs0  # (takes a sample)
        result.tracebacks = ctx.traceback_count() - tb0
        result.ended = time.monotonic()
        cpu = [round(b - a, 2) for a, b in zip(cpu0, ctx.cpu())]
        result.target_cpu_seconds, result.members_cpu_seconds, result.attackers_cpu_seconds = cpu
        ident = ctx.target.identity
        result.rss_peak_growth = ctx.watch.peak(ident, result.started, result.ended, 0, base) - base[0]
        result.fds_peak_growth = ctx.watch.peak(ident, result.started, result.ended, 1, base) - base[1]
        result.honest = ctx.honest.stats(result.started, result.ended)
        ctx.results.append(result)
        ctx.progress(f"  {name}: {summary(result)}")


def summary(r: AttackResult) -> str:
    answers = ", ".join(f"{k} x{v}" for k, v in sorted(r.answers.items(), key=lambda kv: -kv[1])[:4])
    cut = f"; cut {r.cut}/{r.sent}" if r.cut is not None else ""
    return (f"{r.sent} sent -> {answers or 'no answer'}{cut}; log +{r.log_bytes} B, "
            f"{r.tracebacks} tracebacks, {r.http_500} x 500, RSS peak +{r.rss_peak_growth / 2**20:.1f} MiB; "
            f"CPU s target {r.target_cpu_seconds:g}, other members {r.members_cpu_seconds:g}, "
            f"attackers {r.attackers_cpu_seconds:g} in {r.ended - r.started:.1f} s")
