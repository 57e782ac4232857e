"""The directory's endpoints on the control port: publishes to owners and owner queries.

``POST /v1/publish`` and ``POST /v1/locate`` (``location_wire``)
answer only a peer with an inbound session: header ``X-KV-Offload-Session``
(the session id, hex) and ``X-KV-Offload-Auth`` = HMAC-SHA256(session key,
"kv-offload location" NUL op NUL body). An unknown session is refused with
401 before the body is read; a body whose HMAC does not verify gets the same
401. The holder of a publish is the session's peer, never a name in the body,
so a member can only speak for itself. A malformed body is a 400 naming the
problem; a body over ``settings.network.max_body_bytes`` is a 413 and one not whole
within ``request_limits.BODY_SECONDS`` a 408 (``request_limits.read_body``; both close the
connection); JSON is parsed with ``loads_bounded``. Replies to a session on a key this sidecar no longer uses carry
``X-KV-Offload-Rekey: 1`` (the peer re-keys, make before break).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kv_offload_sidecar.control.limits import mark_proven
from kv_offload_sidecar.control.request_limits import (
    REJECTIONS_KEY,
    SERVER_HEADER,
    BodyError,
    read_body,
    source_of,
)
from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER
from kv_offload_sidecar.peers.directory.location_wire import location_auth
from kv_offload_sidecar.peers.sessions import REKEY_HEADER
from kv_offload_sidecar.rejections import clip, loads_bounded

if TYPE_CHECKING:
    from kv_offload_sidecar.peers.handshake import Session
    from kv_offload_sidecar.sidecar import Sidecar

UNAUTHENTICATED = "directory messages need an authenticated session: handshake first"
# Headers of every directory reply (a short Server header instead of aiohttp's version string).
REPLY_HEADERS = {"Server": SERVER_HEADER}


def _refuse(sidecar: Sidecar, request: web.Request, reason: str, detail: str, status: int,
            message: str) -> web.Response:
    sidecar.metrics.protocol_errors.labels(reason=reason).inc()
    rejections = request.app.get(REJECTIONS_KEY)
    if rejections is not None:
        rejections.reject(source_of(request), reason, f"{request.path}: {detail}")
    return web.json_response({"error": message}, status=status)


def _session(sidecar: Sidecar, request: web.Request) -> Session | None:
    try:
        return sidecar.inbound_session(bytes.fromhex(request.headers.get(SESSION_HEADER, "")))
    except ValueError:
        return None


def location_handler(op: str, answer: Callable[[Sidecar, str, Any], dict[str, Any]],
                     sidecar_key: web.AppKey[Sidecar]) -> Callable[[web.Request], Any]:
    """The handler of ``POST /v1/<op>``: session, HMAC, JSON, then ``answer(sidecar, peer, body)``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        sidecar = request.app[sidecar_key]
        session = _session(sidecar, request)
        if session is None:
            return _refuse(sidecar, request, "unauthenticated", "no session", 401, UNAUTHENTICATED)
        try:
            raw = await read_body(request, sidecar.settings.network.max_body_bytes)
        except BodyError as exc:
            resp = _refuse(sidecar, request, exc.reason, str(exc), exc.status, str(exc))
            resp.force_close()
            return resp
        if not hmac.compare_digest(request.headers.get(AUTH_HEADER, "").encode("utf-8", "replace"),
                                   location_auth(session.session_key, op, raw).encode()):
            return _refuse(sidecar, request, "unauthenticated", "bad HMAC", 401, UNAUTHENTICATED)
        mark_proven(request)
        try:
            reply = answer(sidecar, session.peer.identity, loads_bounded(raw))
        except ValueError as exc:
            return _refuse(sidecar, request, "malformed", str(exc), 400, f"{op} body refused: {clip(exc)}")
        body = json.dumps(reply, separators=(",", ":")).encode()
        sidecar.metrics.location_bytes.labels(direction="received").inc(len(raw))
        sidecar.metrics.location_bytes.labels(direction="sent").inc(len(body))
        headers = {**REPLY_HEADERS, REKEY_HEADER: "1"} if sidecar.needs_rekey(session) else REPLY_HEADERS
        return web.Response(body=body, content_type="application/json", headers=headers)

    return handle


def _publish(sidecar: Sidecar, peer: str, body: Any) -> dict[str, Any]:
    return sidecar.location.on_publish(peer, body)


def _locate(sidecar: Sidecar, peer: str, body: Any) -> dict[str, Any]:
    return sidecar.location.on_locate(peer, body)


def add_location_routes(app: web.Application, sidecar_key: web.AppKey[Sidecar]) -> None:
    """Register ``/v1/publish`` and ``/v1/locate``."""
    app.router.add_post("/v1/publish", location_handler("publish", _publish, sidecar_key))
    app.router.add_post("/v1/locate", location_handler("locate", _locate, sidecar_key))
