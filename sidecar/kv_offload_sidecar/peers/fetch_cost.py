"""Fetch or recompute: is loading a prefix from a peer faster than the engine computing it?

Per peer, the sidecar keeps moving averages of what its exchanges cost
(``PeerSpeeds``): the latency until the holder's count is back, and the
bandwidth of the chunks that followed. A run of ``n`` chunks from that peer is
then expected to take ``latency + n x chunk_bytes / bandwidth``; recomputing it
takes ``n x tokens_per_chunk / prefill_tokens_per_second`` (the engine's prefill
rate, configured, or learnt from vLLM's metrics: ``prefill_rate``).
``FetchOrRecompute.worth`` says fetch when the first is shorter; a run not worth
fetching is a miss and the engine recomputes it.

A peer not measured yet is worth trying (its first exchange measures it), and
a prefill rate of 0 turns the decision off (always fetch). The linear prefill
model ignores attention's quadratic term, so it undervalues long prefixes: the
decision errs towards recomputing only where a fetch is clearly slower.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Weight of the newest sample in the moving averages.
EWMA_WEIGHT = 0.2
# Transfers shorter than this say little about bandwidth (timer and scheduling noise).
MIN_TRANSFER_SECONDS = 0.0002


@dataclass(frozen=True)
class PrefillModel:
    """What recomputing costs on this pod's engine."""

    # Prompt tokens the engine prefills per second (0: never recompute instead of fetching).
    prefill_tokens_per_second: float
    # Tokens of KV one chunk holds (the pool config's tokens_per_chunk).
    tokens_per_chunk: int
    # Bytes of one chunk on the wire (the pool config's kv_bytes_per_chunk).
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_second < 0:
            raise ValueError(f"prefill_tokens_per_second {self.prefill_tokens_per_second} must be >= 0 "
                             "(0 turns fetch-or-recompute off: always fetch)")
        if self.tokens_per_chunk <= 0 or self.chunk_bytes <= 0:
            raise ValueError("tokens_per_chunk and chunk_bytes must be positive")

    def recompute_seconds(self, chunks: int) -> float:
        if self.prefill_tokens_per_second <= 0:
            return float("inf")
        return chunks * self.tokens_per_chunk / self.prefill_tokens_per_second


@dataclass
class _Speed:
    # Moving average of seconds from asking a holder to its count (one round trip).
    latency: float | None = None
    # Moving average of chunk bytes per second after the count.
    bandwidth: float | None = None


class PeerSpeeds:
    """Moving averages of each peer's exchange latency and transfer bandwidth."""

    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        self._weight = weight
        self._peers: dict[str, _Speed] = {}

    def observe_latency(self, peer: str, seconds: float) -> None:
        s = self._peers.setdefault(peer, _Speed())
        s.latency = self._mix(s.latency, max(0.0, seconds))

    def observe_transfer(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds < MIN_TRANSFER_SECONDS:
            return
        s = self._peers.setdefault(peer, _Speed())
        s.bandwidth = self._mix(s.bandwidth, nbytes / seconds)

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def estimate(self, peer: str, nbytes: int) -> float | None:
        """Expected seconds to fetch ``nbytes`` from ``peer``; None until it was measured."""
        s = self._peers.get(peer)
        if s is None or s.latency is None:
            return None
        if s.bandwidth is None:
            return s.latency
        return s.latency + nbytes / s.bandwidth

    def view(self) -> dict[str, dict[str, float | None]]:
        return {p: {"latency_seconds": s.latency, "bytes_per_second": s.bandwidth}
                for p, s in sorted(self._peers.items())}

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._weight * (new - old)


class FetchOrRecompute:
    """The per-run decision: fetch ``chunks`` from ``peer``, or leave them to the engine."""

    def __init__(self, model: PrefillModel, speeds: PeerSpeeds | None = None) -> None:
        self.model = model
        self.speeds = speeds or PeerSpeeds()
        # True once a learnt prefill rate replaced the configured one.
        self.learnt = False

    def learn_rate(self, tokens_per_second: float) -> None:
        """The engine's prefill rate as learnt from its metrics replaces the configured one."""
        if tokens_per_second > 0:
            self.model = replace(self.model, prefill_tokens_per_second=tokens_per_second)
            self.learnt = True

    def worth(self, peer: str, chunks: int) -> bool:
        if chunks <= 0:
            return False
        recompute = self.model.recompute_seconds(chunks)
        if recompute == float("inf"):
            return True
        fetch = self.speeds.estimate(peer, chunks * self.model.chunk_bytes)
        return fetch is None or fetch < recompute
