"""What the tier counts, and how those counts reach vLLM's own metrics (``get_stats``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine.sidecar_link import DETACHED_REASONS
from kv_offload_sidecar.engine.vllm_contract import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    connector_stats,
)

# vLLM metric names this tier reports through get_stats().
METRIC_LOOKUPS = "vllm:kv_offload_sidecar_chunk_lookups"
METRIC_REFUSED = "vllm:kv_offload_sidecar_refused"
METRIC_LOOKUP_WAITS = "vllm:kv_offload_sidecar_lookup_waits"
METRIC_LOOKUP_WAIT_MS = "vllm:kv_offload_sidecar_lookup_wait_ms"
METRIC_LOOKUP_WAIT_STEPS = "vllm:kv_offload_sidecar_lookup_wait_steps"
METRIC_LOOKUP_ARRIVALS = "vllm:kv_offload_sidecar_lookup_arrivals"
METRIC_LOOKUP_STEPS_AFTER_ARRIVAL = "vllm:kv_offload_sidecar_lookup_steps_after_arrival"
METRIC_LOOKUP_LATE_ARRIVALS = "vllm:kv_offload_sidecar_lookup_late_arrivals"
METRIC_TIER_CPU_SECONDS = "vllm:kv_offload_tier_cpu_seconds"
METRIC_DETACHED = "vllm:kv_offload_tier_detached"
# Scheduler steps after the sidecar's answer within which vLLM is to see the HIT (issue 24).
HIT_STEPS_TARGET = 2




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
    # Store jobs the sidecar was asked to pace (the engine computes on the host's CPU).
    paced_stores: int = 0
    # Seconds from submit_load to its result, for the latest load jobs (bounded).
    load_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    # Requests that waited (RETRY) for their first lookup answer.
    lookup_waits: int = 0
    # Seconds those requests waited, from their first RETRY to their first answer.
    lookup_wait_seconds: float = 0.0
    # Scheduler steps those requests waited.
    lookup_wait_steps: int = 0
    # Of those, requests answered HIT whose answer said when the sidecar knew it ("arrival":
    # its store read, or a peer holder's count back).
    lookup_arrivals: int = 0
    # Scheduler steps that ended between those arrivals and vLLM seeing HIT, summed.
    lookup_steps_after_arrival: int = 0
    # Those HITs that came more than HIT_STEPS_TARGET steps after their arrival.
    lookup_late_arrivals: int = 0
    # CPU seconds spent in the tier's own code inside vLLM's engine process: its lookup and
    # transfer threads, and vLLM's scheduler thread inside the tier's entry points.
    cpu_seconds: float = 0.0
    # Why the tier refuses its sidecar (the differing fields), or None while they match.
    refused: str | None = None
    # Why the tier runs without a sidecar (``sidecar_link.DETACHED_*``), or None while attached.
    detached: str | None = None




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
        METRIC_DETACHED: OffloadingGaugeMetadata(
            documentation="1 while the tier runs without a kv-offload sidecar, by reason "
                          "(not_injected: vLLM's environment names none; no_sidecar: nothing "
                          "answers; sidecar_error: the attachment fails); vLLM then recomputes "
                          "every offloaded chunk. 0 once a sidecar is attached.",
            labelnames=("reason",)),
        METRIC_LOOKUP_WAITS: OffloadingCounterMetadata(
            documentation="Requests that waited (vLLM saw RETRY) for the sidecar's first lookup "
                          "answer.", labelnames=()),
        METRIC_LOOKUP_WAIT_MS: OffloadingCounterMetadata(
            documentation="Milliseconds those requests waited, from the first RETRY until vLLM "
                          "saw HIT or MISS.", labelnames=()),
        METRIC_LOOKUP_WAIT_STEPS: OffloadingCounterMetadata(
            documentation="vLLM scheduler steps those requests waited.", labelnames=()),
        METRIC_LOOKUP_ARRIVALS: OffloadingCounterMetadata(
            documentation="Requests that waited for a lookup answered HIT, counted when vLLM "
                          "saw the HIT (the count behind ..._lookup_steps_after_arrival).",
            labelnames=()),
        METRIC_LOOKUP_STEPS_AFTER_ARRIVAL: OffloadingCounterMetadata(
            documentation="vLLM scheduler steps that ended between the sidecar knowing a hit "
                          "(its store read, or the peer holder's count back) and vLLM seeing "
                          "HIT, summed over ..._lookup_arrivals.", labelnames=()),
        METRIC_LOOKUP_LATE_ARRIVALS: OffloadingCounterMetadata(
            documentation=f"Of ..._lookup_arrivals, the HITs vLLM saw more than "
                          f"{HIT_STEPS_TARGET} scheduler steps after the sidecar knew them.",
            labelnames=()),
        METRIC_TIER_CPU_SECONDS: OffloadingCounterMetadata(
            documentation="CPU seconds spent in the kv-offload tier's own code in vLLM's engine "
                          "process: its lookup and transfer threads, and vLLM's scheduler thread "
                          "inside the tier's calls (the process's other CPU is vLLM's).",
            labelnames=()),
    }


class StatsReporter:
    """Turns the tier's running totals into vLLM connector stats of what changed since last time."""

    def __init__(self) -> None:
        self._reported: dict[str, float] = {}

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
        for name, total in ((METRIC_LOOKUP_WAITS, stats.lookup_waits),
                            (METRIC_LOOKUP_WAIT_MS, int(stats.lookup_wait_seconds * 1000)),
                            (METRIC_LOOKUP_WAIT_STEPS, stats.lookup_wait_steps),
                            (METRIC_LOOKUP_ARRIVALS, stats.lookup_arrivals),
                            (METRIC_LOOKUP_STEPS_AFTER_ARRIVAL, stats.lookup_steps_after_arrival),
                            (METRIC_LOOKUP_LATE_ARRIVALS, stats.lookup_late_arrivals),
                            (METRIC_TIER_CPU_SECONDS, stats.cpu_seconds)):
            delta = total - self._reported.get(name, 0)
            if delta:
                out.increase_counter(name, delta, ())
                self._reported[name] = total
        out.set_gauge(METRIC_REFUSED, int(stats.refused is not None))
        for reason in DETACHED_REASONS:
            out.set_gauge(METRIC_DETACHED, int(stats.detached == reason), (reason,))
        return out
