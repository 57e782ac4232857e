"""What every request of the control port may cost, proven or not: line, headers, body, idle time.

A request line of at most ``MAX_REQUEST_LINE_BYTES``, ``MAX_HEADERS`` headers of at most
``MAX_HEADER_BYTES`` each (aiohttp answers 400, which ``ServerLog`` turns into a counted,
rate-limited line instead of a traceback), a body whole within ``BODY_SECONDS``
(``read_body``; 408 and close otherwise, 413 over its limit), idle keep-alive closed after
``IDLE_SECONDS`` (``handler_args``). Every refusal increments ``protocol_errors{reason}``;
its log line goes through one ``RejectionLog`` per sidecar (``REJECTIONS_KEY``; one line per
source and reason per minute). Responses say ``Server: kv-offload`` (``SERVER_HEADER``), no
version. What a caller may cost before it proves anything is ``limits.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from kv_offload_sidecar.rejections import RejectionLog, clip

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

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


def source_of(request: web.BaseRequest) -> str:
    """The caller's address as logged (clipped)."""
    return clip(request.remote or "?", 64)


__all__ = [
    "BODY_SECONDS", "IDLE_SECONDS", "LINGER_SECONDS", "MAX_HEADERS", "MAX_HEADER_BYTES",
    "MAX_REQUEST_LINE_BYTES", "REJECTIONS_KEY", "SERVER_HEADER", "BodyError", "ServerLog",
    "handler_args", "read_body", "source_of",
]
