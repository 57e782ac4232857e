"""The sidecar's CPU budget: how many cores its lanes and thread pools may keep busy.

One number for the process, read once (``cpu_budget()``), from:

- its CPU affinity (``sched_getaffinity``);
- its CPU limit: the cgroup CPU quota of its own cgroup and of every parent up to the
  hierarchy's mount, the smallest quota/period winning (a pod-level limit below the
  container's counts). cgroup v2: ``cpu.max`` of the ``0::`` path in ``/proc/self/cgroup``;
  v1 (the ``cpu`` controller's line, present in hybrid mode too):
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``. Mounts come from
  ``/proc/self/mountinfo`` (their root maps the process's path to a folder);
- with no limit, the container's CPU request, given by the operator through the downward
  API as whole millicores in ``CPU_REQUEST_ENV`` (a Kubernetes container with a request
  and no limit may use idle cores beyond it, but is only promised the request).

The smallest of affinity and limit (else request), rounded down, at least 1. A file that
cannot be parsed is skipped, with one log line saying which and why; the budget says where
its number came from (``source``), shown in ``/v1/status`` as ``cpu_budget``.

Consumers: ``data.lanes.lanes_offered`` (TCP lanes and NIXL read lanes),
``data.checksum_threads``, ``tcp.stream_worker.spare_core``, ``bulk_copies.copy_threads``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

log = logging.getLogger(__name__)

# The sidecar container's CPU request in whole millicores, set by the operator's webhook
# (downward API ``resourceFieldRef`` ``requests.cpu``, divisor ``1m``); "0" or unset: none.
CPU_REQUEST_ENV = "KV_OFFLOAD_CPU_REQUEST_MILLICORES"
# Where cgroup hierarchies are mounted on Linux; mount points below it are read below the
# ``cgroup_root`` given to ``read_cpu_budget`` (tests fabricate trees elsewhere).
CGROUP_MOUNT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CpuBudget:
    """How many cores this process may keep busy, and why."""

    # Whole cores, at least 1: the smallest of affinity and CPU limit (else request), rounded down.
    cpus: int
    # Where ``cpus`` came from, one line, e.g. "cgroup v2 /kubepods/pod1/c1 cpu.max 200000 100000".
    source: str
    # Sources skipped because they could not be read or parsed, one line each (empty: none).
    ignored: tuple[str, ...] = ()

    @property
    def said(self) -> tuple[int, str]:
        """``(cpus, source)``, as the sidecar's start line says them."""
        return self.cpus, self.source

    def view(self) -> dict[str, object]:
        return {"cpus": self.cpus, "from": self.source, "ignored": list(self.ignored)}


@functools.cache
def cpu_budget() -> CpuBudget:
    """This process's budget, read at first use (``cpu_budget.cache_clear()`` reads it again)."""
    budget = read_cpu_budget()  # said once the sidecar is ready (its start line), not before:
    log.debug("CPU budget: %d cpus from %s", budget.cpus, budget.source)  # a bad flag is one line
    return budget


def read_cpu_budget(proc: str | Path = "/proc", cgroup_root: str | Path = CGROUP_MOUNT,
                    environ: Mapping[str, str] | None = None, affinity: int | None = None) -> CpuBudget:
    """The budget read from ``proc`` (``self/cgroup``, ``self/mountinfo``), the cgroup files
    under ``cgroup_root`` and ``environ`` (default ``os.environ``); ``affinity``: cores
    allowed (default ``sched_getaffinity``)."""
    ignored: list[str] = []
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cap = _cgroup_limit(Path(proc), Path(cgroup_root), ignored)
    if cap is None:
        cap = _request(os.environ if environ is None else environ, ignored)
    for reason in ignored:
        log.warning("CPU budget: %s", reason)
    if cap is None:
        return CpuBudget(max(1, affinity), f"affinity {affinity} cpus (no CPU limit or request)", tuple(ignored))
    cores, said = cap
    if cores <= affinity:
        return CpuBudget(max(1, cores), said, tuple(ignored))
    return CpuBudget(max(1, affinity), f"affinity {affinity} cpus (below {said})", tuple(ignored))


def _request(environ: Mapping[str, str], ignored: list[str]) -> tuple[int, str] | None:
    raw = environ.get(CPU_REQUEST_ENV, "").strip()
    if not raw or raw == "0":
        return None
    if not raw.isdigit():
        ignored.append(f"{CPU_REQUEST_ENV}={raw!r} ignored: expected whole millicores, e.g. 1500")
        return None
    return int(raw) // 1000, f"CPU request {raw}m ({CPU_REQUEST_ENV})"


def _cgroup_limit(proc: Path, cgroup_root: Path, ignored: list[str]) -> tuple[int, str] | None:
    """(whole cores, description) of the smallest CPU quota on the process's cgroup path."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError as exc:
        ignored.append(f"{proc / 'self' / 'cgroup'} unreadable ({exc.strerror}): no cgroup limit read")
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    v1 = next((e[2] for e in entries if "cpu" in e[1].split(",")), None)
    v2 = next((e[2] for e in entries if e[0] == "0" and e[1] == ""), None)
    if v1 is not None:  # the cpu controller is on v1 (hybrid hosts have a v2 line too)
        version, path = "v1", v1
    elif v2 is not None:
        version, path = "v2", v2
    else:
        return None
    mount = _mount(proc, cgroup_root, version, ignored)
    if mount is None:
        return None
    root, folder = mount
    rel = path[len(root.rstrip("/")):] if path == root or path.startswith(root.rstrip("/") + "/") else ""
    parts = [p for p in rel.split("/") if p]
    best: tuple[Fraction, str] | None = None
    for depth in range(len(parts), -1, -1):  # own cgroup first, then each parent, then the mount's root
        name = "/".join([root.rstrip("/"), *parts[:depth]]) or "/"
        quota = _quota(folder.joinpath(*parts[:depth]), version, ignored)
        if quota is not None and (best is None or quota[0] < best[0]):
            best = (quota[0], f"cgroup {version} {name} {quota[1]}")
    return None if best is None else (int(best[0]), best[1])


def _mount(proc: Path, cgroup_root: Path, version: str, ignored: list[str]) -> tuple[str, Path] | None:
    """(hierarchy path at the mount's root, folder) of the v1 ``cpu`` or the v2 mount."""
    try:
        lines = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError as exc:
        ignored.append(f"{proc / 'self' / 'mountinfo'} unreadable ({exc.strerror}): reading {cgroup_root}")
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        if (version == "v2" and fstype == "cgroup2") or (
                version == "v1" and fstype == "cgroup" and "cpu" in options.split(",")):
            point = fields[4].replace("\\040", " ")
            if point == CGROUP_MOUNT or point.startswith(CGROUP_MOUNT + "/"):
                return fields[3], cgroup_root / point[len(CGROUP_MOUNT):].lstrip("/")
            return fields[3], Path(point)
    if version == "v2":
        return "/", cgroup_root
    folder = next((cgroup_root / n for n in ("cpu,cpuacct", "cpu") if (cgroup_root / n).is_dir()), None)
    if folder is None:
        ignored.append(f"no cgroup v1 cpu mount in {proc / 'self' / 'mountinfo'} or {cgroup_root}")
        return None
    return "/", folder


def _quota(folder: Path, version: str, ignored: list[str]) -> tuple[Fraction, str] | None:
    """The CPU quota set on one cgroup folder as cores (a fraction), and its files' words;
    None when none is set there (or its files are missing or malformed)."""
    names = ("cpu.max",) if version == "v2" else ("cpu.cfs_quota_us", "cpu.cfs_period_us")
    try:
        words = [(folder / n).read_text().split() for n in names]
    except FileNotFoundError:
        return None
    except OSError as exc:
        ignored.append(f"{folder / names[0]} unreadable ({exc.strerror}): skipped")
        return None
    flat = [w for ws in words for w in ws]
    if version == "v2" and flat[:1] == ["max"]:
        return None
    if version == "v1" and flat[:1] == ["-1"]:
        return None
    if len(flat) != 2 or not all(w.isdigit() and int(w) > 0 for w in flat):
        valid = "'max PERIOD' or 'QUOTA PERIOD'" if version == "v2" else "-1 or a positive quota, and a period"
        ignored.append(f"{folder / names[0]} holds {' '.join(flat)!r}, expected {valid}: skipped")
        return None
    quota, period = (int(w) for w in flat)
    said = f"cpu.max {quota} {period}" if version == "v2" else f"cpu.cfs_quota_us {quota} cpu.cfs_period_us {period}"
    return Fraction(quota, period), said


__all__ = ["CGROUP_MOUNT", "CPU_REQUEST_ENV", "CpuBudget", "cpu_budget", "read_cpu_budget"]
