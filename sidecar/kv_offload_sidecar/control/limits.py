"""What a caller of the control port may cost before it proves anything: sizes, times, connections.

A connection is *unproven* until one of its requests proves something: a handshake
accepted (the pool key), a directory message whose HMAC verifies (a session), an
admin token, or a caller inside the pod. Until then ``ConnectionGuard`` holds it to:

- at most ``MAX_UNPROVEN_PER_SOURCE`` open from one source address (one more is answered
  ``503`` and closed at accept, nothing of aiohttp built for it, counted as
  ``too_many_connections``) and ``MAX_UNPROVEN_CONNECTIONS`` from all: when they are all
  taken, a newcomer from a source holding fewer than the largest holder less one takes the
  place of that holder's oldest connection (which is aborted and counted as
  ``too_many_connections``), else it gets the ``503``. So a siege from many addresses
  never locks out a pod it has not seen: the siege's sources lose a connection each time.
  A source address that proved something in the last ``TRUSTED_SOURCE_SECONDS`` (a
  member's pod; ``before_auth.TrustedSources``, shared with the data port) is not held to
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

Once ``TRIM_AFTER_STRANGERS`` left unproven and none is left, what they held goes back to
the system (``data.before_auth.reclaim_memory``, at most every ``TRIM_INTERVAL_SECONDS``).

Every connection, proven or not: a request line of at most ``MAX_REQUEST_LINE_BYTES``,
``MAX_HEADERS`` headers of at most ``MAX_HEADER_BYTES`` each (aiohttp answers 400, which
``ServerLog`` turns into a counted, rate-limited line instead of a traceback), a body
whole within ``BODY_SECONDS`` (``read_body``; 408 and close otherwise), idle keep-alive
closed after ``IDLE_SECONDS``. Every refusal increments ``protocol_errors{reason}``;
its log line goes through one ``RejectionLog`` per sidecar (one line per source and
reason per minute). Responses say ``Server: kv-offload``, no version.

``GuardedSite`` puts the guard in front of an ``AppRunner``'s server; the control app
(``app.py``) tells the guard where requests start and end and what proved itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from kv_offload_sidecar.data.before_auth import (
    MAX_TRUSTED_SOURCES,
    TRUSTED_SOURCE_SECONDS,
    TrustedSources,
    reclaim_memory,
    spread,
)
from kv_offload_sidecar.rejections import RejectionLog, clip

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

# Unproven connections one source address may hold open at once (a peer pod handshakes with
# each of our DP ports, up to 8, at once; a Prometheus scrape holds one).
MAX_UNPROVEN_PER_SOURCE = 32
# Unproven connections all sources together may hold open at once.
MAX_UNPROVEN_CONNECTIONS = 256
# Unproven connections that must have left before their memory is handed back to the system.
TRIM_AFTER_STRANGERS = 32
# Least seconds between two such hand-backs (a full collection and a heap trim cost milliseconds).
TRIM_INTERVAL_SECONDS = 10.0
# Seconds an unproven connection has to deliver a whole request line and headers, from
# connecting or from its last answer (a peer's step 2 follows step 1 within milliseconds).
UNPROVEN_REQUEST_SECONDS = 5.0
# Bytes an unproven connection may send while none of its requests is handled (the headers
# and the first part of a body that arrive with them).
MAX_UNPROVEN_BUFFERED_BYTES = 64 * 1024
# Handshake requests one untrusted source may send in a row (as many as its unproven
# connections may be open at once: a peer pod's links to each of our DP ports, with retries).
HANDSHAKE_BURST = MAX_UNPROVEN_PER_SOURCE
# Connections the control port accepts per pass of the event loop (each costs ~0.1 ms there).
ACCEPT_BATCH = 16
# Seconds any request body has to arrive whole once its headers did.
BODY_SECONDS = 5.0
# Seconds an idle keep-alive connection stays open (above aiohttp's client pool's 15 s, so
# a peer's pooled connection is closed by the peer first and never raced).
IDLE_SECONDS = 30.0
# Seconds a refused request's unread body is still read and dropped, so its caller sees the
# answer rather than a reset.
LINGER_SECONDS = 1.0
# Longest request line (bytes); ours are "POST /v1/handshake HTTP/1.1" and the like.
MAX_REQUEST_LINE_BYTES = 2048
# Longest header line (bytes), e.g. "Authorization: Bearer <admin token>".
MAX_HEADER_BYTES = 4096
# Most headers in one request (our clients send fewer than 10).
MAX_HEADERS = 32
# The Server header of every answer (aiohttp's would name itself and Python, with versions).
SERVER_HEADER = "kv-offload"
# Seconds a refused caller is told to wait (Retry-After of the 503 and the 429), and the delay
# of a rate-limited handshake's 429.
RETRY_AFTER_SECONDS = 1
# The answer to a connection refused at accept (no request of it is parsed).
_BUSY_BODY = b'{"error": "too many unauthenticated connections; retry later"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nServer: kv-offload\r\nContent-Type: application/json\r\n"
         b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
         % (RETRY_AFTER_SECONDS, len(_BUSY_BODY), _BUSY_BODY))

GUARD_KEY: web.AppKey[ConnectionGuard] = web.AppKey("kv_offload_connection_guard")
REJECTIONS_KEY: web.AppKey[RejectionLog] = web.AppKey("kv_offload_rejections", RejectionLog)


def handler_args(metrics: SidecarMetrics, rejections: RejectionLog) -> dict[str, Any]:
    """aiohttp's per-connection settings of a control app (``web.Application(handler_args=...)``)."""
    return {"keepalive_timeout": IDLE_SECONDS, "lingering_time": LINGER_SECONDS,
            "max_line_size": MAX_REQUEST_LINE_BYTES, "max_field_size": MAX_HEADER_BYTES,
            "max_headers": MAX_HEADERS, "logger": ServerLog(metrics, rejections)}


class ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger on the control port: a request aiohttp could not parse (a line
    or header too long, too many headers, not HTTP) is counted and noted in the rejection
    log, one short line, instead of an ERROR with a traceback; anything else is logged as is."""

    def __init__(self, metrics: SidecarMetrics, rejections: RejectionLog) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._metrics = metrics
        self._rejections = rejections

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            oversize = isinstance(exc_info, LineTooLong) or "Too many headers" in str(exc_info)
            reason = "oversize" if oversize else "malformed"
            self._metrics.protocol_errors.labels(reason=reason).inc()
            source = str(args[0]) if args else "?"
            self._rejections.reject(source, f"http {reason}",
                                    f"{type(exc_info).__name__}: {exc_info.message}")
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


class BodyError(Exception):
    """A body refused by ``read_body``: ``status`` 408 or 413, ``reason`` a protocol_errors label."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes and within ``BODY_SECONDS``; BodyError otherwise.

    A declared Content-Length over the limit is refused before a byte is read.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(413, "oversize", f"request body of {declared} bytes exceeds {limit} bytes: "
                        f"send a smaller body")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_SECONDS):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise BodyError(413, "oversize", f"request body exceeds {limit} bytes: send a "
                                    f"smaller body")
    except TimeoutError:
        raise BodyError(408, "timeout", f"request body not complete within {BODY_SECONDS:g} s: "
                        f"send the whole body at once") from None
    return bytes(body)


@dataclass(eq=False)
class _Connection:
    """What the guard knows of one open connection."""

    source: str
    transport: asyncio.Transport
    # Counted against the unproven limits (its source was not trusted when it connected).
    counted: bool
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
        # Open unproven connections by source address, oldest first, and all of them.
        self._unproven: dict[str, OrderedDict[_Connection, None]] = {}
        self._unproven_total = 0
        # Source addresses that proved something lately (the data port's set, when shared).
        self.trusted = trusted if trusted is not None else TrustedSources()
        # Untrusted source address -> [handshake tokens left, monotonic time they were counted].
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        # Unproven connections gone since the last hand-back of memory, and when that was.
        self._departed = 0
        self._trimmed_at = float("-inf")
        # Hand-backs of memory so far (tests read it).
        self.trims = 0
        # Open connections (admitted), by transport.
        self._open: dict[asyncio.BaseTransport, _Connection] = {}

    @property
    def unproven(self) -> int:
        """Open connections held to the unproven limits (``control_connections{state="unproven"}``)."""
        return self._unproven_total

    @property
    def open(self) -> int:
        """Admitted connections open now."""
        return len(self._open)

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """What ``loop.create_server`` calls per accepted connection, in front of ``server``."""
        return lambda: _GuardedProtocol(self, server)

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
            if conn.counted:
                conn.counted = False
                self._release(conn)
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
        if source in self.trusted:
            conn = _Connection(source, transport, counted=False)
            self._open[transport] = conn
            self._arm(conn)
            self._count()
            return conn
        held = self._unproven.get(source)
        if held is not None and len(held) >= MAX_UNPROVEN_PER_SOURCE:
            self.refuse(source, "too_many_connections",
                        f"{MAX_UNPROVEN_PER_SOURCE} unauthenticated connections from it are open")
            return None
        if self._unproven_total >= MAX_UNPROVEN_CONNECTIONS and not self._evict_for(source):
            self.refuse(source, "too_many_connections",
                        f"{MAX_UNPROVEN_CONNECTIONS} unauthenticated connections are open")
            return None
        conn = _Connection(source, transport, counted=True)
        self._unproven.setdefault(source, OrderedDict())[conn] = None
        self._unproven_total += 1
        self._open[transport] = conn
        self._arm(conn)
        self._count()
        return conn

    def _evict_for(self, source: str) -> bool:
        """Make room for a newcomer from ``source``: abort the oldest unproven connection of
        the source holding the most, if that is more than ``source`` would hold with it."""
        if not self._unproven:
            return False
        mine = len(self._unproven.get(source, ()))
        victim_source, held = max(self._unproven.items(), key=lambda kv: len(kv[1]))
        if len(held) <= mine + 1:
            return False
        victim = next(iter(held))
        victim.counted = False
        self._release(victim)
        self._departed += 1
        self._disarm(victim)
        self.refuse(victim_source, "too_many_connections",
                    f"its oldest unauthenticated connection closed for a newcomer "
                    f"({MAX_UNPROVEN_CONNECTIONS} were open)")
        victim.transport.abort()
        return True

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
            if conn.counted:
                conn.counted = False
                self._release(conn)
                self._departed += 1
            self._count()
            if (self._unproven_total == 0 and self._departed >= TRIM_AFTER_STRANGERS
                    and time.monotonic() - self._trimmed_at >= TRIM_INTERVAL_SECONDS):
                self._departed = 0
                self._trimmed_at = time.monotonic()
                asyncio.get_running_loop().call_soon(self._reclaim)

    def _reclaim(self) -> None:
        reclaim_memory()
        self.trims += 1

    def _count(self) -> None:
        unproven = self._unproven_total
        self.metrics.control_connections.labels(state="unproven").set(unproven)
        self.metrics.control_connections.labels(state="proven").set(len(self._open) - unproven)

    def _release(self, conn: _Connection) -> None:
        held = self._unproven.get(conn.source)
        if held is None or held.pop(conn, False) is False:
            return
        self._unproven_total -= 1
        if not held:
            del self._unproven[conn.source]

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


class _GuardedProtocol(asyncio.Protocol):
    """One accepted connection: admitted by the guard, then served by aiohttp's RequestHandler."""

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        self._inner: asyncio.Protocol | None = None
        self._conn: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = transport  # a TCP transport (loop.create_server)
        peer = tcp.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        self._conn = self._guard._admit(source, tcp)  # type: ignore[arg-type]
        if self._conn is None:
            tcp.write(_BUSY)  # type: ignore[attr-defined]
            tcp.close()
            return
        self._inner = _ControlRequestHandler.make(self._server)
        self._inner.connection_made(tcp)

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._conn is None:
            return
        n = self._guard._received(self._conn, len(data))
        if n:  # the part within budget (aiohttp answers 400 to a line too long in it)
            self._inner.data_received(data if n == len(data) else data[:n])

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._guard._closed(self._conn)
        if self._inner is not None:
            self._inner.connection_lost(exc)
            self._inner = None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class _ControlRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, whose own error answers (400 for a request it could not
    parse) carry ``SERVER_HEADER`` like every other answer."""

    @classmethod
    def make(cls, server: web.Server) -> web.RequestHandler:
        # The settings the runner gave its Server (aiohttp keeps them as ``_kwargs``); without
        # them, aiohttp's own handler (and its Server header on its 400s).
        kwargs = getattr(server, "_kwargs", None)
        if not isinstance(kwargs, dict):
            return server()
        return cls(server, loop=asyncio.get_running_loop(), **kwargs)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
        resp = super().handle_error(request, status, exc, message)
        resp.headers["Server"] = SERVER_HEADER
        return resp


class GuardedSite(web.BaseSite):
    """A TCP site whose connections ``guard`` admits and watches before aiohttp serves them."""

    __slots__ = ("_host", "_port", "_guard")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "start the site after runner.setup()"
        # asyncio accepts up to its backlog argument per pass of the loop and sets the kernel's
        # queue to it as well: a short batch keeps a siege's burst of connects from holding the
        # loop (and the data plane it serves) for tens of milliseconds, and the queue is set
        # back to the system's longest once it listens, so a burst is queued, not dropped.
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), self._host, self._port, reuse_address=True,
            backlog=ACCEPT_BATCH)
        for sock in self._server.sockets:
            with socket.socket(fileno=os.dup(sock.fileno())) as listener:
                listener.listen(socket.SOMAXCONN)


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


def source_of(request: web.BaseRequest) -> str:
    """The caller's address as logged (clipped)."""
    return clip(request.remote or "?", 64)


__all__ = [
    "BODY_SECONDS", "HANDSHAKE_BURST", "IDLE_SECONDS", "MAX_HEADERS", "MAX_HEADER_BYTES",
    "MAX_REQUEST_LINE_BYTES", "MAX_UNPROVEN_BUFFERED_BYTES", "MAX_UNPROVEN_CONNECTIONS",
    "MAX_UNPROVEN_PER_SOURCE", "RETRY_AFTER_SECONDS", "SERVER_HEADER", "TRUSTED_SOURCE_SECONDS",
    "UNPROVEN_REQUEST_SECONDS", "BodyError", "ConnectionGuard", "GuardedSite", "ServerLog",
    "guard_middleware", "handler_args", "mark_proven", "rate_limited_answer", "read_body", "source_of",
]
