"""Read a sidecar's Prometheus exposition into plain numbers (demo and benches)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of ``url`` keyed by (sample name, sorted label pairs)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback URL)
        text = resp.read().decode("utf-8")
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(samples: Mapping, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def total(all_samples: Iterable[Mapping], name: str, **labels: str) -> float:
    return sum(value(s, name, **labels) for s in all_samples)


def histogram_quantile(samples: Mapping, name: str, q: float) -> float | None:
    """Upper bucket bound holding quantile ``q`` of histogram ``name`` (None if empty)."""
    buckets = sorted(
        (float(dict(lab)["le"]), v) for (n, lab), v in samples.items()
        if n == f"{name}_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    for bound, count in buckets:
        if count >= target:
            return bound
    return buckets[-1][0]
