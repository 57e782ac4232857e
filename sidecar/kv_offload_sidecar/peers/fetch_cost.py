"""Fetch or recompute: is loading a prefix from a peer faster than the engine computing it?

Per peer, the sidecar keeps moving averages of what its exchanges cost
(``PeerSpeeds``): the latency until the holder's count is back, and the
seconds per byte of the chunks that followed (an average of times, not of rates: one
transfer at a thousandth of the usual rate moves the estimate as much as the time it
took, where a mean of rates would hardly notice it). A run of ``n`` chunks from that peer is
then expected to take ``latency + n x chunk_bytes / bandwidth``; recomputing it
takes ``n x tokens_per_chunk / prefill_tokens_per_second`` (the engine's prefill
rate, configured, or learnt from vLLM's metrics: ``prefill_rate``).
``FetchOrRecompute.worth`` says fetch when the first is shorter; a run not worth
fetching is a miss and the engine recomputes it.

A fetch that ran out of its deadline is a measurement too (``observe_cut_short``): having
moved ``B`` bytes in ``T`` seconds, the peer's rate was at most ``max(B, one chunk) / T``, so a
holder behind a slow link is priced out after its first deadline instead of costing every
request the whole deadline (issue 48). A peer priced out ``PROBE_EVERY`` times in a row is
fetched from once more (``FetchOrRecompute.worth``), so a link that got fast again is measured
again; that probe may cost one deadline in ``PROBE_EVERY`` requests to a peer that stayed slow.

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
# A peer priced out this many times in a row is fetched from once (measured again).
PROBE_EVERY = 64


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
    # Moving average of seconds per chunk byte after the count (the inverse of a bandwidth).
    seconds_per_byte: float | None = None

    @property
    def bandwidth(self) -> float | None:
        return None if not self.seconds_per_byte else 1.0 / self.seconds_per_byte


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
        s.seconds_per_byte = self._mix(s.seconds_per_byte, seconds / nbytes)

    def observe_cut_short(self, peer: str, nbytes: int, seconds: float, chunk_bytes: int) -> None:
        """A transfer that ran out of its deadline after moving ``nbytes`` in ``seconds``: a rate
        of at most ``max(nbytes, chunk_bytes) / seconds`` (nothing landed: less than one chunk)."""
        self.observe_transfer(peer, max(nbytes, chunk_bytes), seconds)

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def estimate(self, peer: str, nbytes: int) -> float | None:
        """Expected seconds to fetch ``nbytes`` from ``peer``; None until it was measured."""
        s = self._peers.get(peer)
        if s is None or s.latency is None:
            return None
        if s.seconds_per_byte is None:
            return s.latency
        return s.latency + nbytes * s.seconds_per_byte

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
        # Peer -> decisions in a row that priced it out (every PROBE_EVERY-th fetches anyway).
        self._priced_out: dict[str, int] = {}

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
        if fetch is None or fetch < recompute:
            self._priced_out.pop(peer, None)
            return True
        n = self._priced_out[peer] = self._priced_out.get(peer, 0) + 1
        if n >= PROBE_EVERY:  # measure it again: its link may be fast by now
            del self._priced_out[peer]
            return True
        return False
