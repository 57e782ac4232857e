"""The pool under attack and what ``kv-offload bench attack`` watches of it.

``attack_pool`` builds a LocalPool of real ``kv-offload sidecar`` processes on
127.0.0.1 at the sidecar's default log level (INFO, as a pod runs it).
``PoolWatch`` samples every member's RSS, open descriptors and log size from
``/proc`` and the log files (never over the ports under attack) on a thread,
counts Python tracebacks in the logs (and where they were raised), snapshots a
member's ``kv_offload_*`` counters, and tells whether every member is alive and
connected to all the others.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kv_offload_tools.chaos.pool import chaos_config
from kv_offload_testing.local_pool import LocalPool
from kv_offload_testing.scrape import Samples
from kv_offload_testing.sidecar_process import SidecarProcess

# Seconds between samples of RSS, descriptors and log bytes.
SAMPLE_SECONDS = 0.25
# Counters the honest load moves on its own: left out of an attack's "counters moved".
HONEST_COUNTERS = ("chunk_lookups", "peer_bytes", "peer_fetches", "lookup_messages", "location_",
                   "fetch_decisions", "route_hint", "evictions", "key_reloads", "peer_fetch_duration",
                   "python_", "process_")
_TRACEBACK = "Traceback (most recent call last):"
_FILE_LINE = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def attack_pool(members: int, chunk_bytes: int, capacity_bytes: int, transport: str) -> LocalPool:
    """``members`` sidecars of one pool (a full mesh), started by the caller."""
    return LocalPool(members, transport=transport, config=chaos_config(chunk_bytes),
                     capacity_bytes=capacity_bytes, fetch_deadline_seconds=2.0, log_level="INFO")


@dataclass
class Sample:
    """One reading of every member."""

    # Monotonic time.
    at: float
    # identity -> (rss bytes, open descriptors, log bytes)
    members: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _log_bytes(sc: SidecarProcess) -> int:
    try:
        return os.path.getsize(sc.log_path)
    except OSError:
        return 0


def read_sample(members: list[SidecarProcess]) -> Sample:
    s = Sample(time.monotonic())
    for sc in members:
        rss = 0
        if sc.alive():
            try:
                rss = sc.rss_bytes()
            except OSError:
                pass
        s.members[sc.identity] = (rss, _fds(sc.proc.pid) if sc.alive() else 0, _log_bytes(sc))  # type: ignore[union-attr]
    return s


def tracebacks(text: str) -> list[str]:
    """Each traceback in ``text`` as ``file:line in func: ExceptionLine`` (its innermost frame)."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _TRACEBACK not in line:
            continue
        where = "?"
        j = i + 1
        while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
            m = _FILE_LINE.match(lines[j])
            if m:
                where = f"{os.path.basename(m['file'])}:{m['line']} in {m['func']}"
            j += 1
        exc = lines[j].strip() if j < len(lines) else "?"
        out.append(f"{where}: {exc[:160]}")
    return out


def counters(samples: Samples) -> dict[str, float]:
    """The ``*_total`` samples an attack may move, keyed ``name{label=value,...}``."""
    out = {}
    for (name, labels), v in samples.items():
        short = name.removeprefix("kv_offload_")
        if not name.endswith("_total") or short.startswith(HONEST_COUNTERS):
            continue
        lab = ",".join(f"{k}={val}" for k, val in sorted(labels))
        out[f"{short}{{{lab}}}" if lab else short] = v
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after) if after[k] != before.get(k, 0.0)}


class PoolWatch(threading.Thread):
    """Samples the members every SAMPLE_SECONDS until ``stop``."""

    def __init__(self, pool: LocalPool) -> None:
        super().__init__(name="kvo-attack-watch", daemon=True)
        self.pool = pool
        self.members = pool.members()
        self.samples: list[Sample] = []
        # Log offsets at the start: tracebacks and bytes are counted from there.
        self.log_start = {sc.identity: _log_bytes(sc) for sc in self.members}
        self._halt = threading.Event()
        self._lock = threading.Lock()
        # Extra series sampled with the members (e.g. hostile connections open), by name.
        self.gauges: dict[str, Any] = {}
        self.gauge_series: dict[str, list[tuple[float, float]]] = {}

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_SECONDS):
            self.sample()

    def sample(self) -> Sample:
        s = read_sample(self.members)
        with self._lock:
            self.samples.append(s)
            for name, fn in self.gauges.items():
                self.gauge_series.setdefault(name, []).append((s.at, float(fn())))
        return s

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def series(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def peak(self, identity: str, t0: float, t1: float, what: int = 0,
             floor: tuple[int, int, int] | None = None) -> int:
        """Highest reading ``what`` (0 rss, 1 fds) of a member in [t0, t1] (and of ``floor``)."""
        values = [s.members[identity][what] for s in self.series() if t0 <= s.at <= t1]
        return max(values + ([floor[what]] if floor else []), default=0)

    def log_text(self, identity: str) -> str:
        sc = self.pool[identity]
        try:
            with open(sc.log_path, "rb") as fh:
                fh.seek(self.log_start[identity])
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def tracebacks(self) -> dict[str, list[str]]:
        """identity -> tracebacks logged since the watch began."""
        return {sc.identity: tracebacks(self.log_text(sc.identity)) for sc in self.members}

    def connected(self, timeout: float) -> dict[str, str]:
        """identity -> "" when alive and connected to every other member, else what is wrong
        (waits up to ``timeout`` for the mesh to be whole). A member whose ``/v1/peers`` does
        not answer is judged by what the others see of it."""
        deadline = time.monotonic() + timeout
        want = {sc.identity for sc in self.members}
        while True:
            wrong: dict[str, str] = {}
            views: dict[str, set[str]] = {}
            for sc in self.members:
                if not sc.alive():
                    wrong[sc.identity] = f"exited with code {sc.proc.returncode}"  # type: ignore[union-attr]
                    continue
                try:
                    code, body = sc.get("/v1/peers")
                except OSError as exc:
                    wrong[sc.identity] = f"GET /v1/peers failed ({type(exc).__name__})"
                    continue
                if code != 200 or not isinstance(body, dict):
                    wrong[sc.identity] = f"GET /v1/peers answered {code}"
                    continue
                views[sc.identity] = {p["identity"] for p in body.get("peers", []) if p.get("state") == "connected"}
                lacking = sorted(want - {sc.identity} - views[sc.identity])
                if lacking:
                    wrong[sc.identity] = f"not connected to {', '.join(lacking)}"
            for ident, why in list(wrong.items()):
                if why.startswith("GET /v1/peers") and views:
                    seen = all(ident in v for v in views.values())
                    wrong[ident] = f"{why}; the others {'see it connected' if seen else 'miss it'}"
            if not wrong or time.monotonic() > deadline:
                return {sc.identity: wrong.get(sc.identity, "") for sc in self.members}
            time.sleep(0.2)
