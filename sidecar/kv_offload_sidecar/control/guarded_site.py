"""The control port's listening site: each accepted connection admitted by the guard first.

``GuardedSite`` puts a ``limits.ConnectionGuard`` in front of an ``AppRunner``'s server: a
connection the guard refuses at accept is answered ``503`` (``Retry-After:
RETRY_AFTER_SECONDS``) and closed, nothing of aiohttp built for it; an admitted one is served
by aiohttp's ``RequestHandler``, which sees only the bytes within the guard's budget and
whose own error answers carry ``SERVER_HEADER``. At most ``ACCEPT_BATCH`` connections are
accepted per pass of the event loop; the kernel's queue is the system's longest. Accepted
connections inherit the listener's keepalive and ``TCP_USER_TIMEOUT`` (``keepalive``).
"""

from __future__ import annotations

import asyncio
import os
import socket

from aiohttp import web

from kv_offload_sidecar.control.limits import RETRY_AFTER_SECONDS, ConnectionGuard, _Connection
from kv_offload_sidecar.control.request_limits import SERVER_HEADER
from kv_offload_sidecar.keepalive import keep_alive

# Connections the control port accepts per pass of the event loop (each costs ~0.1 ms there).
ACCEPT_BATCH = 16
# The answer to a connection refused at accept (no request of it is parsed).
_BUSY_BODY = b'{"error": "too many unauthenticated connections; retry later"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nServer: kv-offload\r\nContent-Type: application/json\r\n"
         b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
         % (RETRY_AFTER_SECONDS, len(_BUSY_BODY), _BUSY_BODY))


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
            lambda: _GuardedProtocol(self._guard, server), self._host, self._port, reuse_address=True,
            backlog=ACCEPT_BATCH)
        for sock in self._server.sockets:
            with socket.socket(fileno=os.dup(sock.fileno())) as listener:
                listener.listen(socket.SOMAXCONN)
                keep_alive(listener)


__all__ = ["ACCEPT_BATCH", "GuardedSite"]
