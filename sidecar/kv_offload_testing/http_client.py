"""HTTP to the sidecars on this host (control API and ``/metrics``), never through a proxy.

A proxy from the environment would swallow loopback requests, so every
request of the tools goes through one opener without proxies. The benches'
own HTTP stand-ins are served on loopback by ``serve_on_loopback``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, body: Any = None, timeout: float = 5.0,
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, decoded JSON or text) of a GET, or of a POST when ``body`` is given.

    ``body`` is sent as JSON, or as it is when it is bytes (malformed input on purpose).
    """
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def http_text(url: str, timeout: float = 5.0) -> str:
    """The body of a GET that must succeed (``urllib.error.HTTPError`` otherwise)."""
    with _OPENER.open(url, timeout=timeout) as resp:
        return resp.read().decode("utf-8")


async def serve_on_loopback(app: Any) -> tuple[Any, int]:
    """Serve the aiohttp ``app`` on a free loopback port, without an access log: (its runner, to
    clean up, and the port)."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]
