"""A sidecar's Prometheus exposition as plain numbers (local pool, demo, benches, tests)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from kv_offload_testing.http_client import http_text

# (sample name, its label pairs) -> value, e.g.
# ("kv_offload_peer_bytes_total", frozenset({("direction", "sent")})) -> 4096.0
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of the exposition served at ``url``."""
    return parse_metrics(http_text(url, timeout))


def value(samples: Mapping, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0.0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def total(all_samples: Iterable[Mapping], name: str, **labels: str) -> float:
    """``value`` summed over several sidecars' samples."""
    return sum(value(s, name, **labels) for s in all_samples)
