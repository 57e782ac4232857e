"""Where `bench gpu`'s processes run: the holder's side (its sidecar, raw TCP's sender) on the
first half of this machine's CPUs, the fetcher's side (its sidecar, raw TCP's receiver) on the
second half (one CPU: both on it), each given its CPUs before it starts, so a sidecar derives
its lanes from the CPUs it will run on. ``--sidecar-cpus N`` gives each side the first N CPUs of
its half instead: a pod whose sidecar is given N cores (its CPU budget, ``cpu_budget``, reads
the affinity as it would a CPU limit), its lanes one per core."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence


def split_cpus(cpus: Sequence[int]) -> tuple[list[int], list[int]]:
    """(holder's, fetcher's) CPUs: the first and second half of ``cpus`` (one CPU: both)."""
    ordered = sorted(cpus)
    half = max(1, len(ordered) // 2)
    return ordered[:half], (ordered[half:] or ordered)


def first_cpus(halves: tuple[Sequence[int], Sequence[int]], count: int) -> tuple[list[int], list[int]]:
    """(holder's, fetcher's) first ``count`` CPUs of each half of ``split_cpus``; a count
    larger than a half is refused, naming the most that fits."""
    most = min(len(halves[0]), len(halves[1]))
    if not 1 <= count <= most:
        raise ValueError(f"sidecar CPUs {count}: each sidecar has {most} CPUs of its own here (1-{most})")
    return sorted(halves[0])[:count], sorted(halves[1])[:count]


def cpu_list(cpus: Sequence[int]) -> str:
    """``0-7``-style list of CPU numbers."""
    out, ordered = [], sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


@contextlib.contextmanager
def started_on(cpus: Sequence[int]) -> Iterator[None]:
    """Processes started meanwhile by this thread inherit ``cpus`` as their affinity (so a
    sidecar sees its CPUs from its first instruction on and derives its lanes from them)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
