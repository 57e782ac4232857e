"""The benches' percentiles: nearest rank, so a p99 is a wait some request really had."""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (0 <= q < 1) of ``values`` by nearest rank: the sorted value at rank
    ``int(q * n)`` (the largest for a q that rounds past it); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
