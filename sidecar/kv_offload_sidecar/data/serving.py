"""What the planes' servers share: the session check that opens every connection (the
nonce sent, the client's proof checked with ``base.auth_proof``), the deadline of a chunk's
send, a stopping server's grace, and unexpected errors told in one line."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Mapping, Sized
from typing import Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import Authorize, auth_proof
from kv_offload_sidecar.rejections import clip

log = logging.getLogger(__name__)

# Seconds the server waits for one chunk to leave before giving up on a client.
DEFAULT_SEND_TIMEOUT = 30.0


def make_nonce() -> bytes:
    """A fresh server challenge."""
    return secrets.token_bytes(proto.NONCE_BYTES)


def check_auth(authorize: Authorize, nonce: bytes, answer: proto.AuthResponse) -> None:
    """Raise ``ProtocolError('unauthenticated')`` unless the answer proves the session."""
    try:
        key = authorize(answer.session_id)
    except Exception as exc:  # a broken authorize callback must not crash the server
        log.error("data plane: the authorize callback failed: %s", describe(exc),
                  exc_info=log.isEnabledFor(logging.DEBUG))
        raise proto.ProtocolError("unauthenticated", "session check failed") from exc
    if not key or not hmac.compare_digest(auth_proof(key, nonce), answer.proof):
        raise proto.ProtocolError(
            "unauthenticated", "unknown session or wrong proof; handshake again on the control port")


async def wait_until_idle(tasks: Sized, connections: Mapping[Any, Any], grace_seconds: float) -> None:
    """A stopping server's grace: while ``tasks`` (connections being served) remain, wait
    until every one of ``connections`` says ``idle(now)``, for at most ``grace_seconds``."""
    deadline = time.monotonic() + grace_seconds
    while tasks and time.monotonic() < deadline:
        now = time.monotonic()
        if all(c.idle(now) for c in connections.values()):
            return
        await asyncio.sleep(0.05)


def describe(exc: BaseException) -> str:
    """An unexpected exception as one short line (its type and clipped text, no traceback)."""
    return f"{type(exc).__name__}: {clip(exc)}"
