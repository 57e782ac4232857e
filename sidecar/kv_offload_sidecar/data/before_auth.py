"""What a stranger may cost a server before it proves anything: one mechanism for every port.

``StrangerLimit`` holds the unproven connections of one server (the data plane's, or the
control ports' guard, ``control/limits.py``): at most ``MAX_UNPROVEN_PER_SOURCE`` from one
source address and ``MAX_UNPROVEN_CONNECTIONS`` from all. When all are taken, a newcomer
from a source holding fewer than the largest holder less one takes the place of that
holder's oldest connection (closed and counted as ``too_many_connections``), else it is
refused (counted the same); so a siege from many addresses never locks out a pod it has
not seen. A source address that proved something lately (``TrustedSources``: a session
on the data port, or a handshake, session HMAC or admin token on the control ports; one
set per sidecar) is not held to these limits at all, so a flood of strangers never
refuses a member. Once ``TRIM_AFTER_STRANGERS`` left without a proof and none is left,
what they held goes back to the system (``reclaim_memory``, ``TRIM_DELAY_SECONDS`` later
and at most every ``TRIM_INTERVAL_SECONDS``).

On the data port: no frame longer than ``protocol.MAX_UNAUTHENTICATED_PAYLOAD`` (refused
at its header), every step from accept to AUTH_OK within ``auth_timeout``
(``DEFAULT_AUTH_TIMEOUT``; up to ``DEADLINE_SPREAD`` more at random, ``spread``, so a burst
does not expire at once; past it ``timeout``). Every refusal is counted in
``protocol_errors{reason}``; its log line goes through a ``rejections.RejectionLog``
(``refuse``: one line per source and reason per interval, values clipped). Once
authenticated, none of these limits applies. What the sidecar holds once it is up is
frozen out of the garbage collector (``freeze_long_lived``), so neither that hand-back nor
the collections a flood's allocations trigger stall the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data.base import count_protocol_error
from kv_offload_sidecar.rejections import RejectionLog

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

# Seconds a new connection has for every step before AUTH_OK together (TLS, challenge, proof).
DEFAULT_AUTH_TIMEOUT = 5.0
# Unproven connections one source address may hold open at once on one server (a peer pod
# handshakes with each of our DP ports, up to 8, at once; opens a data connection per link,
# UCX lanes each; a Prometheus scrape holds one).
MAX_UNPROVEN_PER_SOURCE = 16
# Unproven connections all sources together may hold open at once on one server (asyncio
# holds 256 KiB per TLS connection in its handshake: 16 MiB at most on a TLS data port).
MAX_UNPROVEN_CONNECTIONS = 64
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


@dataclass(eq=False)
class Place:
    """One connection's place among a server's unproven ones."""

    source: str
    # Held to the limits (its source was not trusted when it connected, and it is still held).
    counted: bool
    # Closes the connection when a newcomer takes its place, given the reason (None: until the
    # connection runs, it cannot be).
    evict: Callable[[str], None] | None = None


class StrangerLimit:
    """The unproven connections of one server, per source and in all (the event loop's; not
    thread-safe): ``admit(source)`` gives a ``Place`` or the reason of a refusal, ``leave(place,
    proved)`` gives it back (a proof makes the source ``trusted``)."""

    def __init__(self, trusted: TrustedSources | None = None) -> None:
        # Most unproven connections of one source, and of all (tests lower them).
        self.per_source = MAX_UNPROVEN_PER_SOURCE
        self.total = MAX_UNPROVEN_CONNECTIONS
        # Strangers gone before the memory is handed back (tests lower it).
        self.trim_after = TRIM_AFTER_STRANGERS
        # Sources exempt from both limits (a sidecar's data and control ports share the set).
        self.trusted = trusted if trusted is not None else TrustedSources()
        # Counted places by source, oldest first.
        self._held: dict[str, OrderedDict[Place, None]] = {}
        # Counted places now.
        self.count = 0
        # Places left without a proof since the heap was last trimmed.
        self._strangers = 0
        # Heap trims so far (tests read it).
        self.trims = 0
        self._trim_at: asyncio.TimerHandle | None = None
        self._trimmed = -TRIM_INTERVAL_SECONDS  # monotonic time of the last trim

    def admit(self, source: str) -> Place | str:
        """A place for a new connection from ``source``, or why it is refused (nothing taken)."""
        if source in self.trusted:
            return Place(source, counted=False)
        held = self._held.get(source)
        if held is not None and len(held) >= self.per_source:
            return f"too many unauthenticated connections from this address ({self.per_source})"
        if self.count >= self.total and not self._evict_for(source):
            return f"too many unauthenticated connections from all sources ({self.total})"
        place = Place(source, counted=True)
        self._held.setdefault(source, OrderedDict())[place] = None
        self.count += 1
        return place

    def leave(self, place: Place, proved: bool) -> None:
        """The connection of ``place`` proved itself (``proved``; it stays open, no longer
        counted) or ended without a proof. Again for the same place: nothing."""
        if proved:
            self.trusted.proved(place.source)
        if not place.counted:
            return
        self._release(place, stranger=not proved)

    def _evict_for(self, source: str) -> bool:
        """Make room for a newcomer from ``source``: close the oldest connection of the source
        holding the most, if that is more than ``source`` would hold with it."""
        if not self._held:
            return False
        mine = len(self._held.get(source, ()))
        held = max(self._held.values(), key=len)
        victim = next((p for p in held if p.evict is not None), None)
        if len(held) <= mine + 1 or victim is None:
            return False
        self._release(victim, stranger=True)
        assert victim.evict is not None
        victim.evict(f"its oldest unauthenticated connection closed for a newcomer ({self.total} were open)")
        return True

    def _release(self, place: Place, *, stranger: bool) -> None:
        place.counted = False
        held = self._held.get(place.source)
        if held is not None and held.pop(place, False) is None:
            self.count -= 1
            if not held:
                del self._held[place.source]
        if stranger:
            self._strangers += 1
        if self.count == 0 and self._strangers >= self.trim_after and self._trim_at is None:
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

    _limit: StrangerLimit

    @property
    def trusted_sources(self) -> TrustedSources:
        """The source addresses exempt from its connection limits (a sidecar's control ports
        share it: a proof on either counts for both)."""
        return self._limit.trusted

    @property
    def unauthenticated(self) -> int:
        """Connections accepted that have not proved a session yet and are held to the limits
        (a trusted source's are not)."""
        return self._limit.count

    @property
    def memory_reclaims(self) -> int:
        """Times the memory of departed unauthenticated connections was handed back."""
        return self._limit.trims

