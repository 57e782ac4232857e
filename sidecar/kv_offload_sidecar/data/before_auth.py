"""What a data connection may cost its server before it proves its session.

No frame longer than ``protocol.MAX_UNAUTHENTICATED_PAYLOAD`` (refused at its header),
every step from accept to AUTH_OK within ``auth_timeout`` (``DEFAULT_AUTH_TIMEOUT``; up to
``DEADLINE_SPREAD`` more at random, ``spread``, so a burst does not expire at once), at
most ``MAX_UNAUTHENTICATED_PER_SOURCE`` such connections per source address and
``MAX_UNAUTHENTICATED_CONNECTIONS`` in all (``UnauthenticatedLimit``: more are refused at
accept, counted as ``too_many_connections``; a connection past the deadline as
``timeout``), and what departed strangers held handed back (``reclaim_memory``).
A source address that proved something lately (``TrustedSources``: a session on this
data port, or a handshake, session HMAC or admin token on the sidecar's control ports,
which share the server's set) is not held to the two connection limits, so a flood of
strangers never refuses a member's new data connection; its connections still get the
frame limit and the deadline.
Every refusal is counted in ``protocol_errors{reason}``; its log line goes through a
``rejections.RejectionLog`` (``refuse``: one line per source and reason per interval,
values clipped). Once authenticated, none of these limits applies. What the sidecar holds
once it is up is frozen out of the garbage collector (``freeze_long_lived``), so neither
that hand-back nor the collections a flood's allocations trigger stall the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import random
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data.base import count_protocol_error
from kv_offload_sidecar.rejections import RejectionLog

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

# Seconds a new connection has for every step before AUTH_OK together (TLS, challenge, proof).
DEFAULT_AUTH_TIMEOUT = 5.0
# Unauthenticated connections one source address may hold at once (a peer opens one per link).
MAX_UNAUTHENTICATED_PER_SOURCE = 8
# Unauthenticated connections a server holds at once from all sources; more are refused.
MAX_UNAUTHENTICATED_CONNECTIONS = 64
# Connections ended without a proof after which, once none is left, the heap is trimmed.
TRIM_AFTER_STRANGERS = 16
# Seconds from the last unauthenticated connection's end to the heap trim (its buffers go first).
TRIM_DELAY_SECONDS = 0.5
# Fewest seconds between two trims: a full garbage collection pauses the loop for milliseconds.
TRIM_INTERVAL_SECONDS = 10.0
# Share of a stranger's deadline added at random (0 to 10 % more), so the connections of one
# burst do not all expire in one pass of the event loop (300 at once held it for ~40 ms).
DEADLINE_SPREAD = 0.1
# Seconds a source address that proved something stays exempt from the connection limits on
# strangers (a member's pod re-proves within seconds: sessions, directory messages).
TRUSTED_SOURCE_SECONDS = 600.0
# Most source addresses remembered as trusted (the oldest is forgotten first).
MAX_TRUSTED_SOURCES = 4096


def refuse(metrics: SidecarMetrics | None, rejections: RejectionLog, source: str,
           reason: str, detail: object) -> None:
    """Count one refusal in ``protocol_errors{reason}`` (every event) and note it in the
    rate-limited ``rejections`` log (``detail`` clipped there)."""
    count_protocol_error(metrics, reason)
    rejections.reject(source, reason, detail)


def spread(seconds: float) -> float:
    """``seconds`` plus a random share of up to ``DEADLINE_SPREAD`` of it."""
    return seconds * (1.0 + random.random() * DEADLINE_SPREAD)


def reclaim_memory() -> bool:
    """Give what departed strangers held back to the system: collect the reference cycles
    their connections left (asyncio's TLS transports sit in cycles until a full collection),
    then trim the C heap (glibc ``malloc_trim``; a freed 256 KiB TLS buffer stays in the heap
    otherwise). False where there is no ``malloc_trim``."""
    gc.collect()
    trim = _MALLOC_TRIM[0]
    if trim is None:
        try:
            trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            trim = False
        _MALLOC_TRIM[0] = trim
    if not trim:
        return False
    trim(0)
    return True


_MALLOC_TRIM: list[Any] = [None]


def freeze_long_lived() -> None:
    """Collect once, then move every object alive now out of the collector's sight
    (``gc.freeze``): called once a sidecar is up, when what it holds (modules, store, metrics,
    apps) lives as long as the process. A full collection then walks only what came later:
    ``reclaim_memory``'s, and the ones a stranger's flood of short-lived connections triggers,
    take well under a millisecond instead of tens (46,000 objects at start) on the loop that
    serves the data plane."""
    gc.collect()
    gc.freeze()


def thaw_long_lived() -> None:
    """Undo ``freeze_long_lived`` as the sidecar stops (an in-process sidecar of a test leaves
    nothing the collector can no longer free)."""
    gc.unfreeze()


class TrustedSources:
    """Source addresses that proved something within ``TRUSTED_SOURCE_SECONDS`` (at most
    ``MAX_TRUSTED_SOURCES``, the least recently proven forgotten first); one set per sidecar,
    shared by its data port and its control ports (the event loop's; not thread-safe)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        # Source address -> clock time of its last proof, least recent first.
        self._proven: OrderedDict[str, float] = OrderedDict()

    def proved(self, source: str) -> None:
        """``source`` proved something just now."""
        self._proven[source] = self._clock()
        self._proven.move_to_end(source)
        while len(self._proven) > MAX_TRUSTED_SOURCES:
            self._proven.popitem(last=False)

    def __contains__(self, source: object) -> bool:
        since = self._proven.get(source)  # type: ignore[call-overload]
        if since is None:
            return False
        if self._clock() - since < TRUSTED_SOURCE_SECONDS:
            return True
        del self._proven[source]  # type: ignore[arg-type]
        return False


class UnauthenticatedLimit:
    """Counts a server's connections that have not proved a session yet, per source and in
    all: ``admit(source)`` takes a place or says why not, ``leave(source, proved)`` gives it
    back (and a proof makes the source ``trusted``). A trusted source takes places but is
    never refused. Once ``TRIM_AFTER_STRANGERS`` left without a proof and none is left, the
    memory they held goes back to the system (``reclaim_memory``, at most every
    ``TRIM_INTERVAL_SECONDS``)."""

    def __init__(self, per_source: int = MAX_UNAUTHENTICATED_PER_SOURCE,
                 total: int = MAX_UNAUTHENTICATED_CONNECTIONS,
                 trusted: TrustedSources | None = None) -> None:
        self._per_source = per_source
        self._total = total
        # Sources exempt from both limits (the sidecar's control ports read and add to it too).
        self.trusted = trusted if trusted is not None else TrustedSources()
        self._by_source: dict[str, int] = {}
        # Unauthenticated connections now.
        self.count = 0
        # Connections that left without a proof since the heap was last trimmed.
        self._strangers = 0
        # Heap trims so far (tests read it).
        self.trims = 0
        self._trim_at: asyncio.TimerHandle | None = None
        self._trimmed = -TRIM_INTERVAL_SECONDS  # monotonic time of the last trim

    def admit(self, source: str) -> str | None:
        """Take a place for a new connection from ``source``; None when admitted, else the
        reason it is refused (nothing taken then)."""
        held = self._by_source.get(source, 0)
        if source not in self.trusted:
            if self.count >= self._total:
                return f"too many unauthenticated connections ({self._total} from all sources)"
            if held >= self._per_source:
                return f"too many unauthenticated connections from one address ({self._per_source})"
        self._by_source[source] = held + 1
        self.count += 1
        return None

    def leave(self, source: str, proved: bool) -> None:
        """The connection from ``source`` authenticated (``proved``) or ended without a proof."""
        held = self._by_source.get(source, 0)
        if held <= 1:
            self._by_source.pop(source, None)
        else:
            self._by_source[source] = held - 1
        self.count = max(0, self.count - 1)
        if proved:
            self.trusted.proved(source)
        else:
            self._strangers += 1
        if self.count == 0 and self._strangers >= TRIM_AFTER_STRANGERS and self._trim_at is None:
            # Later: a closed TLS transport frees its buffers a few loop passes after close().
            delay = max(TRIM_DELAY_SECONDS, self._trimmed + TRIM_INTERVAL_SECONDS - time.monotonic())
            self._trim_at = asyncio.get_running_loop().call_later(delay, self._trim)

    def _trim(self) -> None:
        self._trim_at = None
        if self.count == 0:  # else the next stranger to leave the last place schedules it again
            self._strangers = 0
            self._trimmed = time.monotonic()
            self.trims += reclaim_memory()


class CountsStrangers:
    """What a data-plane server says of its connections before the proof (its ``_limit``)."""

    _limit: UnauthenticatedLimit

    @property
    def trusted_sources(self) -> TrustedSources:
        """The source addresses exempt from its connection limits (a sidecar's control ports
        share it: a proof on either counts for both)."""
        return self._limit.trusted

    @property
    def unauthenticated(self) -> int:
        """Connections accepted that have not proved a session yet."""
        return self._limit.count

    @property
    def memory_reclaims(self) -> int:
        """Times the memory of departed unauthenticated connections was handed back."""
        return self._limit.trims

