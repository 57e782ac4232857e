"""The directory's endpoints on the control port: publishes to owners and owner queries.

``POST /v1/publish`` and ``POST /v1/locate`` (``peers/location_wire.py``)
answer only a peer with an inbound session: header ``X-KV-Offload-Session``
(the session id, hex) and ``X-KV-Offload-Auth`` = HMAC-SHA256(session key,
"kv-offload location" NUL op NUL body). An unknown session is refused with
401 before the body is read; a body whose HMAC does not verify gets the same
401. The holder of a publish is the session's peer, never a name in the body,
so a member can only speak for itself. A malformed body is a 400 naming the
problem. Replies to a session on a key this sidecar no longer uses carry
``X-KV-Offload-Rekey: 1`` (the peer re-keys, make before break).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER
from kv_offload_sidecar.peers.location_wire import location_auth
from kv_offload_sidecar.peers.sessions import REKEY_HEADER

if TYPE_CHECKING:
    from kv_offload_sidecar.peers.handshake import Session
    from kv_offload_sidecar.sidecar import Sidecar

UNAUTHENTICATED = "directory messages need an authenticated session: handshake first"
# Headers of every directory reply (a short Server header instead of aiohttp's version string).
REPLY_HEADERS = {"Server": "kv-offload"}


def _refuse(sidecar: Sidecar) -> web.Response:
    sidecar.metrics.protocol_errors.labels(reason="unauthenticated").inc()
    return web.json_response({"error": UNAUTHENTICATED}, status=401)


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
            return _refuse(sidecar)
        raw = await request.read()
        if not hmac.compare_digest(request.headers.get(AUTH_HEADER, ""),
                                   location_auth(session.session_key, op, raw)):
            return _refuse(sidecar)
        try:
            reply = answer(sidecar, session.peer.identity, json.loads(raw.decode("utf-8")))
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            sidecar.metrics.protocol_errors.labels(reason="malformed").inc()
            return web.json_response({"error": f"{op} body refused: {exc}"}, status=400)
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
