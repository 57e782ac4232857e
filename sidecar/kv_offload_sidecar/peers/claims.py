"""Peers whose claims lie: claims checked against answers, liars left alone for a while.

A directory owner names the holders of a chunk, and a holder answers for the
chunks it published; the sidecar asks the holder an owner names. A claim that
the answer does not back (the holder returns fewer chunks than were claimed)
is a *false claim*, counted against the holder and the owner that named it
(``peer_reads``). A few are normal (a chunk evicted before its owner heard of
it); a peer that claims every key (a compromised or broken pod) would
otherwise be asked on every request. ``ClaimAudit`` counts false claims per
peer in a sliding window; a peer whose false claims pass ``min_false`` and
``max_false_ratio`` of its claims is *distrusted*: it is not chosen for
``backoff_seconds`` (doubling on each repeat, up to ``max_backoff_seconds``). So a
lying peer costs the pool only misses, and a bounded number of messages: at
most ``min_false`` false chunks' worth of requests per back-off period.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class _PeerRecord:
    # (monotonic time, chunks claimed, chunks the answer did not back)
    events: deque[tuple[float, int, int]] = field(default_factory=deque)
    # monotonic time until which the peer is not chosen
    distrusted_until: float = 0.0
    # back-off of the next distrust
    next_backoff: float = 0.0


class ClaimAudit:
    """False claims per peer in a sliding window, and the peers currently distrusted."""

    def __init__(self, *, window_seconds: float = 10.0, min_false: int = 32,
                 max_false_ratio: float = 0.5, backoff_seconds: float = 5.0,
                 max_backoff_seconds: float = 300.0,
                 on_false_claims: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window_seconds
        self._min_false = min_false
        self._ratio = max_false_ratio
        self._backoff = backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._on_false = on_false_claims
        self._clock = clock
        self._peers: dict[str, _PeerRecord] = {}

    def record(self, peer: str, claimed: int, backed: int) -> None:
        """The answer ``peer`` led to backed ``backed`` of the ``claimed`` chunks."""
        false = max(0, claimed - backed)
        if false and self._on_false is not None:
            self._on_false(false)
        now = self._clock()
        rec = self._peers.setdefault(peer, _PeerRecord())
        rec.events.append((now, claimed, false))
        while rec.events and rec.events[0][0] < now - self._window:
            rec.events.popleft()
        total_claimed = sum(c for _, c, _ in rec.events)
        total_false = sum(f for _, _, f in rec.events)
        if total_false >= self._min_false and total_false > self._ratio * total_claimed \
                and rec.distrusted_until <= now:
            rec.next_backoff = min(self._max_backoff, rec.next_backoff * 2 or self._backoff)
            rec.distrusted_until = now + rec.next_backoff
            rec.events.clear()
            log.warning("peer %s claimed %d chunks it did not serve (of %d claimed in %.0f s): not asking "
                        "it for %.0f s", peer, total_false, total_claimed, self._window, rec.next_backoff)

    def distrusted(self) -> set[str]:
        """Peers not to choose now."""
        now = self._clock()
        return {p for p, rec in self._peers.items() if rec.distrusted_until > now}
