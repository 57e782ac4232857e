"""The peer links' HTTP client (handshakes and location messages) and its wire constants.

One ``aiohttp.ClientSession`` per sidecar (``control_client``) carries every handshake step
and location message to every peer. Its connections are bounded (``BoundedConnector``): at
most ``CONTROL_CONNECTIONS`` open at once, in use or idle, all peers together (a message past
that waits for one, within its own timeout; a released connection past the bound closes the
oldest idle one), and one idle for ``CONTROL_KEEPALIVE_SECONDS`` is closed, so a sidecar of
a large pool holds control connections only to the peers it messaged lately (the owners it
publishes to, those it asks), never one per member. Where it messages more peers than that
within the keep-alive, connections are opened and closed instead (``bench scale`` counts
how many per second). Each socket has the kernel's liveness rule (``keepalive``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from kv_offload_sidecar.keepalive import keep_alive
from kv_offload_sidecar.peers.data_links import MAX_DATA_LINKS
from kv_offload_sidecar.peers.handshake import MAX_HANDSHAKE_BODY_BYTES, HandshakeError
from kv_offload_sidecar.rejections import clip, loads_bounded

SESSION_HEADER = "X-KV-Offload-Session"
AUTH_HEADER = "X-KV-Offload-Auth"
# Largest location reply read from a peer (bytes).
MAX_LOCATION_REPLY_BYTES = 64 << 10
# Most field-diff lines of a peer's refusal kept (each clipped to rejections.CLIP_CHARS).
MAX_REFUSAL_DIFF_LINES = 64
# Location messages (the path /v1/<op> on the peer's control port).
LOCATION_OPS = ("publish", "locate")
# Headers aiohttp would add to every peer request that no peer reads (bytes on every message).
SKIPPED_REQUEST_HEADERS = ("User-Agent", "Accept", "Accept-Encoding")
# Control connections (handshakes, location messages) open at once, to all peers together.
CONTROL_CONNECTIONS = MAX_DATA_LINKS
# Seconds an idle control connection is kept for the next message (a few publish intervals).
CONTROL_KEEPALIVE_SECONDS = 5.0


class BoundedConnector(aiohttp.TCPConnector):
    """A TCPConnector whose idle connections count against ``limit`` too: aiohttp's bounds only
    the connections in use and keeps every idle one for ``keepalive_timeout``; this one closes
    the oldest idle connections past ``limit`` whenever one is released."""

    # Idle connections closed to keep within the bound, since start.
    trimmed = 0

    def _release(self, key: Any, protocol: Any, *, should_close: bool = False) -> None:
        super()._release(key, protocol, should_close=should_close)
        self.trim_idle()

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._conns.values())

    def trim_idle(self) -> None:
        """Close the oldest idle connections until in use + idle <= ``limit``."""
        conns = self._conns
        excess = self.idle_count() + len(self._acquired) - self.limit
        while excess > 0 and conns:
            key = min((k for k, idle in conns.items() if idle), key=lambda k: conns[k][0][1], default=None)
            if key is None:
                return
            protocol, _ = conns[key].popleft()
            if not conns[key]:
                del conns[key]
            protocol.close()
            self.trimmed += 1
            excess -= 1


def control_client(timeout_seconds: float, limit: int = CONTROL_CONNECTIONS) -> aiohttp.ClientSession:
    """The links' HTTP client: bounded connections, closed when idle, kept alive by the kernel."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_seconds),
        connector=BoundedConnector(limit=limit, keepalive_timeout=CONTROL_KEEPALIVE_SECONDS,
                                   socket_factory=_keepalive_socket),
        trust_env=False, skip_auto_headers=SKIPPED_REQUEST_HEADERS)


async def post_handshake_step(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                              count_rejection: Callable[[HandshakeError, str], None]) -> Any:
    """One handshake step; its reply (at most MAX_HANDSHAKE_BODY_BYTES, ``loads_bounded``).
    A peer's refusal is raised as ``HandshakeError`` (told to ``count_rejection`` first)."""
    async with http.post(url, json=body) as resp:
        raw = await resp.content.read(MAX_HANDSHAKE_BODY_BYTES + 1)
        if len(raw) > MAX_HANDSHAKE_BODY_BYTES:
            raise ConnectionError(f"handshake reply exceeds {MAX_HANDSHAKE_BODY_BYTES} bytes")
        try:
            data = loads_bounded(raw)
        except ValueError:
            data = None
        if resp.status == 403 and isinstance(data, dict) and data.get("reason"):
            diff = data.get("diff")
            lines = diff[:MAX_REFUSAL_DIFF_LINES] if isinstance(diff, list) else []
            exc = HandshakeError(clip(data["reason"], 64), f"peer rejected us: {clip(data.get('error'))}",
                                 [clip(x) for x in lines])
            count_rejection(exc, url)
            raise exc
        if resp.status != 200:
            raise ConnectionError(f"handshake HTTP {resp.status}: "
                                  f"{clip(data.get('error')) if isinstance(data, dict) else ''}")
        return data


def _keepalive_socket(addr_info: Any) -> Any:
    """A socket of the links' HTTP client, with the kernel's liveness rule (``keepalive``)."""
    import socket

    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    keep_alive(sock)
    return sock
