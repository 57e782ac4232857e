"""What `bench vllm` reads around each measured request: CPU time of processes, vLLM's
counters (through the engine driver's ``metrics`` op) and a sidecar's ``/metrics``.

A ``Probe`` snapshot is taken before and after a request; ``delta`` subtracts them.
Metrics that are not there (yet) read as absent, never as zero: a phase the
sidecar or the tier does not expose is reported missing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# vLLM counters the tier adds (``tier_stats`` documents them): the requests that waited for a
# lookup answer, milliseconds and scheduler steps of those waits; of them the HITs whose
# answer said when the sidecar knew it, the steps from there to vLLM's HIT (summed) and
# those later than the target; the CPU seconds of the tier's own code in vLLM's process.
from kv_offload_sidecar.engine.tier_stats import (
    METRIC_LOOKUP_ARRIVALS as LOOKUP_ARRIVALS,
    METRIC_LOOKUP_LATE_ARRIVALS as LOOKUP_LATE_ARRIVALS,
    METRIC_LOOKUP_STEPS_AFTER_ARRIVAL as LOOKUP_STEPS_AFTER_ARRIVAL,
    METRIC_LOOKUP_WAIT_MS as LOOKUP_WAIT_MS,
    METRIC_LOOKUP_WAIT_STEPS as LOOKUP_WAIT_STEPS,
    METRIC_LOOKUP_WAITS as LOOKUP_WAITS,
    METRIC_TIER_CPU_SECONDS as TIER_CPU_SECONDS,
)

# The tier's counters a Probe reads from an engine.
TIER_COUNTERS = (LOOKUP_WAIT_MS, LOOKUP_WAIT_STEPS, LOOKUP_WAITS, LOOKUP_ARRIVALS,
                 LOOKUP_STEPS_AFTER_ARRIVAL, LOOKUP_LATE_ARRIVALS, TIER_CPU_SECONDS)
# vLLM's own tiering counters, per tier label.
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
TIER_CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
# The sidecar's histogram of each phase of the engine's store and load jobs.
TRANSFER_SECONDS = "kv_offload_engine_transfer_seconds"

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` (all its threads), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields after "(comm)": state is [0]; utime and stime are stat fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def off_main_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of the threads of ``pid`` other than its main thread (alive now).

    In vLLM's engine core the main thread runs the scheduler loop (which steps
    without pause while a request waits, e.g. on a lookup); the tier's own
    threads are among the others.
    """
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return None
    total = 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, comm) of every process."""
    out: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        out[int(entry)] = (int(text.rsplit(")", 1)[1].split()[1]), comm)
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every process under it (those alive now)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in _processes().items():
        children.setdefault(ppid, []).append(pid)
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process ``root`` and every process under it (those alive now)."""
    return sum(cpu_seconds(pid) or 0.0 for pid in process_tree(root))


def tree_threads(root: int) -> list[int]:
    """Every thread of process ``root`` and of the processes under it (those alive now)."""
    out = []
    for pid in process_tree(root):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            out += [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    return out


def thread_cores(root: int) -> dict[str, int]:
    """How many threads of ``root``'s process tree may run on each set of cores, by the
    set ("0", "1", "0,1")."""
    out: dict[str, int] = {}
    for tid in tree_threads(root):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            cores = ",".join(map(str, sorted(os.sched_getaffinity(tid))))
            out[cores] = out.get(cores, 0) + 1
    return dict(sorted(out.items()))


def descendant(root: int, comm_prefix: str) -> int | None:
    """The first process under ``root`` whose name starts with ``comm_prefix``
    (vLLM names its processes ``VLLM::EngineCore`` and ``VLLM::Worker``)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop(0)
        if procs[pid][1].startswith(comm_prefix):
            return pid
        stack.extend(children.get(pid, []))
    return None


def vllm_value(samples: Sequence[Mapping[str, Any]], name: str,
               **labels: str) -> float | None:
    """Sum of the raw vLLM samples ``name`` (or ``name_total``) with ``labels``;
    None when vLLM exposes no such metric."""
    want = set(labels.items())
    found = [s["value"] for s in samples
             if s["name"] in (name, f"{name}_total") and want <= set(s["labels"].items())]
    return float(sum(found)) if found else None


def transfer_phases(samples: Mapping[tuple[str, frozenset], float]) -> dict[tuple[str, str], float]:
    """(op, phase) -> seconds summed by the sidecar's transfer histogram (and ``count``)."""
    out: dict[tuple[str, str], float] = {}
    for (name, labels), v in samples.items():
        if name in (f"{TRANSFER_SECONDS}_sum", f"{TRANSFER_SECONDS}_count"):
            lab = dict(labels)
            kind = "seconds" if name.endswith("_sum") else "count"
            out[(lab.get("op", "?"), f"{lab.get('phase', '?')}:{kind}")] = v
    return out


@dataclass
class Snapshot:
    """Counters at one instant."""

    cpu: dict[str, float | None] = field(default_factory=dict)
    vllm: dict[str, float | None] = field(default_factory=dict)
    phases: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    sidecar: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Probe:
    """The processes and endpoints one measurement reads.

    ``pids``: role -> pid (e.g. ``engine_b``, ``sidecar_1``); ``engines``: role ->
    engine driver whose vLLM counters are read; ``sidecars``: role -> SidecarProcess.
    """

    pids: Mapping[str, int]
    engines: Mapping[str, Any]
    sidecars: Mapping[str, Any]
    tier_label: str

    def snapshot(self, vllm_engines: Iterable[str] | None = None) -> Snapshot:
        snap = Snapshot(cpu={role: cpu_seconds(pid) for role, pid in self.pids.items()})
        for role, pid in self.pids.items():
            if role.startswith("engine"):
                snap.cpu[f"{role}.off_main"] = off_main_cpu_seconds(pid)
        for role in (self.engines if vllm_engines is None else vllm_engines):
            m = self.engines[role].metrics(raw=True)
            for name in TIER_COUNTERS:
                snap.vllm[f"{role}:{name}"] = vllm_value(m, name)
            for name in (TIER_READ_BYTES, TIER_WRITE_BYTES, TIER_CHUNK_HITS):
                snap.vllm[f"{role}:{name}"] = vllm_value(m, name, tier=self.tier_label)
        for role, sc in self.sidecars.items():
            samples = sc.metrics()
            snap.phases[role] = transfer_phases(samples)
            snap.sidecar[role] = {
                "peer_bytes_received": _value(samples, "kv_offload_peer_bytes_total",
                                              direction="received"),
                "peer_bytes_sent": _value(samples, "kv_offload_peer_bytes_total", direction="sent"),
                "peer_hit": _value(samples, "kv_offload_chunk_lookups_total", result="peer_hit"),
                "local_hit": _value(samples, "kv_offload_chunk_lookups_total", result="local_hit"),
                "store_chunks": _value(samples, "kv_offload_store_chunks"),
            }
        return snap


def _value(samples: Mapping[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def _sub(a: float | None, b: float | None) -> float | None:
    """``a - b``; a counter absent before and present after was created by the request (0)."""
    if a is None:
        return None
    return a - (b or 0.0)


def delta(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """``after - before``: cpu seconds per role, vLLM counters (None when absent), the
    sidecars' phase seconds ``{role: {"load.fetch": s, ...}}`` and other counters."""
    phases: dict[str, dict[str, float]] = {}
    for role, now in after.phases.items():
        then = before.phases.get(role, {})
        secs = {f"{op}.{p.split(':')[0]}": v - then.get((op, p), 0.0)
                for (op, p), v in now.items() if p.endswith(":seconds")}
        phases[role] = secs
    return {
        "cpu_s": {r: _sub(after.cpu.get(r), before.cpu.get(r)) for r in after.cpu},
        "vllm": {k: _sub(v, before.vllm.get(k)) for k, v in after.vllm.items()},
        "phases": phases,
        "sidecar": {r: {k: v - before.sidecar.get(r, {}).get(k, 0.0) for k, v in c.items()}
                    for r, c in after.sidecar.items()},
    }
