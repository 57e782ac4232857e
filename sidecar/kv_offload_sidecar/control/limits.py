"""What a caller of the control port may cost before it proves anything: connections, time, bytes.

A connection is *unproven* until one of its requests proves something: a handshake
accepted (the pool key), a directory message whose HMAC verifies (a session), an
admin token, or a caller inside the pod. Until then ``ConnectionGuard`` holds it to:

- at most ``MAX_UNPROVEN_PER_SOURCE`` open from one source address and
  ``MAX_UNPROVEN_CONNECTIONS`` from all, with a newcomer taking the place of the largest
  holder's oldest when all are taken: ``data.before_auth.StrangerLimit``, the one mechanism
  and set of constants of every port (a refused one is answered ``503`` and closed at
  accept, nothing of aiohttp built for it; an evicted one is aborted; both are counted as
  ``too_many_connections``). A source address that proved something in the last
  ``TRUSTED_SOURCE_SECONDS`` (a member's pod; shared with the data port) is not held to
  these two at all;
- at most ``HANDSHAKE_BURST`` handshake requests in a row, then one per
  ``UNPROVEN_REQUEST_SECONDS / HANDSHAKE_BURST`` on average, per source address that is
  not trusted (a token bucket; a member's pod handshakes once per link and DP port): more
  get ``429`` before their body is read or anything is parsed, counted as
  ``rate_limited``, and only after ``RETRY_AFTER_SECONDS`` (``rate_limited_answer``), so
  a flood's connection costs one short answer a second, and strangers together at most
  ``MAX_UNPROVEN_CONNECTIONS`` a second, whatever their clients' speed;
- a whole request (line and headers) within ``UNPROVEN_REQUEST_SECONDS`` of connecting or
  of its last answer (up to ``before_auth.DEADLINE_SPREAD`` more at random, so a burst of
  them is not cut in one pass of the loop), so a silent, idle or slow-loris connection is
  cut (``timeout``);
- at most ``MAX_UNPROVEN_BUFFERED_BYTES`` received while no request of it is handled
  (``oversize``): more is read and dropped until the deadline above closes it, so an
  answer aiohttp already owes it (a 400 for a line too long) still reaches it.

Once enough strangers left and none is left, what they held goes back to the system
(``StrangerLimit``, ``data.before_auth.reclaim_memory``).

What every request costs, proven or not (line, headers, body, idle time, the Server
header), is ``request_limits.py``'s; ``guarded_site.GuardedSite`` puts the guard in front
of an ``AppRunner``'s server; the control app (``app.py``) tells the guard where requests
start and end (``guard_middleware``) and what proved itself (``mark_proven``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from kv_offload_sidecar.data.before_auth import (
    MAX_TRUSTED_SOURCES,
    MAX_UNPROVEN_CONNECTIONS,
    MAX_UNPROVEN_PER_SOURCE,
    TRUSTED_SOURCE_SECONDS,
    Place,
    StrangerLimit,
    TrustedSources,
    spread,
)

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.rejections import RejectionLog

# Seconds an unproven connection has to deliver a whole request line and headers, from
# connecting or from its last answer (a peer's step 2 follows step 1 within milliseconds).
UNPROVEN_REQUEST_SECONDS = 5.0
# Bytes an unproven connection may send while none of its requests is handled (the headers
# and the first part of a body that arrive with them).
MAX_UNPROVEN_BUFFERED_BYTES = 64 * 1024
# Handshake requests one untrusted source may send in a row (both steps of a peer pod's
# links to each of our DP ports, up to 8, with retries).
HANDSHAKE_BURST = 32
# Seconds a refused caller is told to wait (Retry-After of the 503 and the 429), and the delay
# of a rate-limited handshake's 429.
RETRY_AFTER_SECONDS = 1

GUARD_KEY: web.AppKey[ConnectionGuard] = web.AppKey("kv_offload_connection_guard")


@dataclass(eq=False)
class _Connection:
    """What the guard knows of one open connection."""

    source: str
    transport: asyncio.Transport
    # Its place among the unproven connections (not counted once proven or when its source was
    # trusted at accept).
    place: Place
    proven: bool = False
    # Requests of this connection being handled now (pipelining makes it more than one).
    handling: int = 0
    # Bytes received since its last request started or ended (unproven connections only).
    buffered: int = 0
    # It sent more than MAX_UNPROVEN_BUFFERED_BYTES outside a request: the rest is dropped.
    over: bool = False
    deadline: asyncio.TimerHandle | None = None


class ConnectionGuard:
    """Admission, deadlines and byte budget of unproven connections, for every control port of
    one sidecar (thread-unsafe; the sidecar's event loop)."""

    def __init__(self, metrics: SidecarMetrics, rejections: RejectionLog,
                 trusted: TrustedSources | None = None) -> None:
        self.metrics = metrics
        self.rejections = rejections
        # The unproven connections' places (source addresses that proved something lately are
        # the data port's set, when shared).
        self.limit = StrangerLimit(trusted)
        self.trusted = self.limit.trusted
        # Untrusted source address -> [handshake tokens left, monotonic time they were counted].
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        # Open connections (admitted), by transport.
        self._open: dict[asyncio.BaseTransport, _Connection] = {}

    @property
    def unproven(self) -> int:
        """Open connections held to the unproven limits (``control_connections{state="unproven"}``)."""
        return self.limit.count

    @property
    def trims(self) -> int:
        """Hand-backs of the memory departed strangers held."""
        return self.limit.trims

    @property
    def open(self) -> int:
        """Admitted connections open now."""
        return len(self._open)

    # ---- the app's side -------------------------------------------------------------

    def request_started(self, request: web.BaseRequest) -> None:
        conn = self._open.get(request.transport)  # type: ignore[arg-type]
        if conn is not None:
            conn.handling += 1
            conn.buffered = 0
            self._disarm(conn)

    def request_done(self, request: web.BaseRequest, *, closing: bool = False) -> None:
        """A request ended; ``closing``: its answer closes the connection (no deadline then)."""
        conn = self._open.get(request.transport)  # type: ignore[arg-type]
        if conn is not None:
            conn.handling -= 1
            conn.buffered = 0
            if not conn.proven and conn.handling == 0 and not closing:
                self._arm(conn)

    def proven(self, request: web.BaseRequest) -> None:
        """The request proved itself: its connection leaves the unproven limits."""
        conn = self._open.get(request.transport)  # type: ignore[arg-type]
        if conn is not None and not conn.proven:
            conn.proven = True
            self._disarm(conn)
            self.limit.leave(conn.place, proved=True)
            self._count()
        if conn is not None:
            self.trusted.proved(conn.source)
            self._buckets.pop(conn.source, None)

    def allow_handshake(self, source: str) -> bool:
        """One handshake request from ``source`` may be handled: always for a trusted source,
        else while its bucket (``HANDSHAKE_BURST`` tokens, refilled at ``HANDSHAKE_BURST`` per
        ``UNPROVEN_REQUEST_SECONDS``) has a token."""
        if source in self.trusted:
            return True
        now = time.monotonic()
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = [float(HANDSHAKE_BURST), now]
            while len(self._buckets) > MAX_TRUSTED_SOURCES:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        rate = HANDSHAKE_BURST / UNPROVEN_REQUEST_SECONDS
        bucket[0] = min(float(HANDSHAKE_BURST), bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        if bucket[0] < 1.0:
            return False
        bucket[0] -= 1.0
        return True

    def refuse(self, source: str, reason: str, detail: object) -> None:
        """Count one refusal and note it in the rejection log."""
        self.metrics.protocol_errors.labels(reason=reason).inc()
        self.rejections.reject(source, reason, detail)

    # ---- the protocol's side ----------------------------------------------------------

    def _admit(self, source: str, transport: asyncio.Transport) -> _Connection | None:
        place = self.limit.admit(source)
        if isinstance(place, str):
            self.refuse(source, "too_many_connections", place)
            return None
        conn = _Connection(source, transport, place)
        if place.counted:
            place.evict = lambda why: self._evict(conn, why)
        self._open[transport] = conn
        self._arm(conn)
        self._count()
        return conn

    def _evict(self, conn: _Connection, why: str) -> None:
        """A newcomer takes the place of ``conn`` (an unproven connection of the largest holder)."""
        self._disarm(conn)
        self.refuse(conn.source, "too_many_connections", why)
        conn.transport.abort()

    def _received(self, conn: _Connection, nbytes: int) -> int:
        """How many of ``nbytes`` just received to pass on: all but what takes an unproven
        connection over its budget outside a request (counted once; dropped from then on,
        until its deadline closes it)."""
        if conn.over:
            return 0
        if conn.proven or conn.handling:
            return nbytes
        room = MAX_UNPROVEN_BUFFERED_BYTES - conn.buffered
        conn.buffered += nbytes
        if nbytes <= room:
            return nbytes
        conn.over = True
        self.refuse(conn.source, "oversize", f"more than {MAX_UNPROVEN_BUFFERED_BYTES} bytes "
                    f"without a whole request")
        return room

    def _closed(self, conn: _Connection) -> None:
        self._disarm(conn)
        if self._open.pop(conn.transport, None) is not None:
            self.limit.leave(conn.place, proved=False)  # nothing when it proved itself or was evicted
            self._count()

    def _count(self) -> None:
        unproven = self.limit.count
        self.metrics.control_connections.labels(state="unproven").set(unproven)
        self.metrics.control_connections.labels(state="proven").set(len(self._open) - unproven)

    def _arm(self, conn: _Connection) -> None:
        self._disarm(conn)
        loop = asyncio.get_running_loop()
        conn.deadline = loop.call_later(spread(UNPROVEN_REQUEST_SECONDS), self._expire, conn)

    @staticmethod
    def _disarm(conn: _Connection) -> None:
        if conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None

    def _expire(self, conn: _Connection) -> None:
        conn.deadline = None
        if conn.proven or (conn.handling and not conn.over) or conn.transport.is_closing():
            return
        self.refuse(conn.source, "timeout", f"no whole request within {UNPROVEN_REQUEST_SECONDS:g} s")
        conn.transport.abort()  # nothing to flush; abort also drops what the kernel still holds


def guard_middleware(guard: ConnectionGuard) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Tells ``guard`` where each request of its connections starts and ends."""

    @web.middleware
    async def watched(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        guard.request_started(request)
        closing = False
        try:
            response = await handler(request)
            closing = response.keep_alive is False
            return response
        finally:
            guard.request_done(request, closing=closing)

    return watched


async def rate_limited_answer() -> web.Response:
    """The ``429`` of a handshake over its source's rate, given after ``RETRY_AFTER_SECONDS``
    (a client asking again at once on the same connection asks once a second)."""
    await asyncio.sleep(RETRY_AFTER_SECONDS)
    return web.json_response({"error": "too many handshakes from this address; retry later"}, status=429,
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def mark_proven(request: web.Request) -> None:
    """The request proved itself (pool key, session HMAC, admin token, the pod itself)."""
    guard = request.app.get(GUARD_KEY)
    if guard is not None:
        guard.proven(request)


__all__ = [
    "HANDSHAKE_BURST", "MAX_UNPROVEN_BUFFERED_BYTES", "MAX_UNPROVEN_CONNECTIONS",
    "MAX_UNPROVEN_PER_SOURCE", "RETRY_AFTER_SECONDS", "TRUSTED_SOURCE_SECONDS",
    "UNPROVEN_REQUEST_SECONDS", "ConnectionGuard", "guard_middleware", "mark_proven", "rate_limited_answer",
]
