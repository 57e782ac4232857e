"""What the tier counts, and how those counts reach vLLM's own metrics (``get_stats``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine.vllm_contract import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    connector_stats,
)

# vLLM metric names this tier reports through get_stats().
METRIC_LOOKUPS = "vllm:kv_offload_sidecar_chunk_lookups"
METRIC_REFUSED = "vllm:kv_offload_sidecar_refused"




@dataclass
class TierStats:
    """Chunk-level counters of one tier, read by vLLM's metrics, the simulated engine and the demo."""

    # Chunk keys whose lookup the sidecar answered.
    lookups: int = 0
    # Keys answered as present in this pod's sidecar store.
    local_hits: int = 0
    # Keys answered as present on a peer pod.
    peer_hits: int = 0
    # Keys answered as absent, unanswered by the lookup deadline, or refused.
    misses: int = 0
    # Lookup batches that failed or ran past the deadline.
    lookup_timeouts: int = 0
    # Bytes copied from the sidecar into primary-tier rows.
    bytes_loaded: int = 0
    # Bytes copied from primary-tier rows into the sidecar.
    bytes_stored: int = 0
    # Load jobs that failed in whole or part (vLLM recomputes the failed chunks).
    failed_loads: int = 0
    # Store jobs that failed (the chunks stay only in vLLM's primary tier).
    failed_stores: int = 0
    # Seconds from submit_load to its result, for the latest load jobs (bounded).
    load_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    # Why the tier refuses its sidecar (the differing fields), or None while they match.
    refused: str | None = None




def metric_definitions() -> dict[str, Any]:
    """The tier's metrics, as vLLM registers them (``build_metric_definitions``)."""
    return {
        METRIC_LOOKUPS: OffloadingCounterMetadata(
            documentation="Chunk lookups the kv-offload sidecar answered, by result "
                          "(local_hit: this pod's sidecar, peer_hit: another pod's, miss).",
            labelnames=("result",)),
        METRIC_REFUSED: OffloadingGaugeMetadata(
            documentation="1 while the tier refuses its kv-offload sidecar because its "
                          "fingerprint, chunk size or hash seed differs from this engine's."),
    }


class StatsReporter:
    """Turns the tier's running totals into vLLM connector stats of what changed since last time."""

    def __init__(self) -> None:
        self._reported: dict[str, int] = {}

    def report(self, stats: TierStats) -> Any:
        """vLLM's ``OffloadingConnectorStats`` (None outside vLLM)."""
        out = connector_stats()
        if out is None:
            return None
        for result, total in (("local_hit", stats.local_hits), ("peer_hit", stats.peer_hits),
                              ("miss", stats.misses)):
            delta = total - self._reported.get(result, 0)
            if delta:
                out.increase_counter(METRIC_LOOKUPS, delta, (result,))
                self._reported[result] = total
        out.set_gauge(METRIC_REFUSED, int(stats.refused is not None))
        return out
