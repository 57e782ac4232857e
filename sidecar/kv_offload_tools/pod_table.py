"""What both demos count per pod, and the table they print it in (one row per pod, then the total)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from kv_offload_testing import scrape


@dataclass
class PodCounts:
    """What one pod's sidecar did in a demo; each demo's report adds its engine's counts after these."""

    # Pod name: "pod-0", "pod-1", ...; "total" for the sum of all pods.
    name: str
    # The sidecar's metrics URL ("" for the total).
    metrics_url: str
    # Requests the pod's engine ran.
    requests: int = 0
    # Chunk keys found in this pod's sidecar store, on a peer pod, and nowhere.
    local_hits: int = 0
    peer_hits: int = 0
    misses: int = 0
    # Chunk bytes the sidecar received from peers.
    bytes_moved: int = 0
    # Handshakes the sidecar rejected (the intruder's, which hashes with another seed).
    handshake_rejections: int = 0
    # Lookups that stopped waiting for a peer's answer and counted as misses (a loaded host).
    answers_given_up: int = 0

    def read_sidecar(self, samples: Mapping) -> None:
        """Bytes moved and handshakes rejected, from the sidecar's scraped metrics."""
        self.bytes_moved = int(scrape.value(samples, "kv_offload_peer_bytes_total", direction="received"))
        self.handshake_rejections = int(scrape.value(samples, "kv_offload_handshakes_total",
                                                     result="rejected"))
        self.answers_given_up = int(sum(scrape.value(samples, "kv_offload_peer_answers_given_up_total",
                                                     reason=r) for r in ("silence", "deadline")))

    def given_up_note(self) -> str:
        """A line saying why peer hits may be missing, when lookups gave up on a peer ("" if none)."""
        if not self.answers_given_up:
            return ""
        return (f"{self.answers_given_up} lookups stopped waiting for a slow peer's answer and "
                "counted as misses (kv_offload_peer_answers_given_up_total): this host is loaded")

    def add(self, other: PodCounts) -> None:
        """Add ``other``'s counts to these, for the total row: every field after the name and URL
        (numbers add up, lists of seconds join)."""
        for f in fields(self)[2:]:
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


Counts = TypeVar("Counts", bound=PodCounts)


def total_of(pods: Sequence[Counts], kind: type[Counts]) -> Counts:
    """The "total" row of ``pods``: a ``kind`` with every pod's counts added."""
    total = kind("total", "")
    for pod in pods:
        total.add(pod)
    return total


def format_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``rows`` under ``head``, each column as wide as its widest cell, with a dashed rule under the
    header and above the last row (the total)."""
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)
