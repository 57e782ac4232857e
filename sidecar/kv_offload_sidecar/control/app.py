"""The control plane: one aiohttp application per DP port of the pod.

Endpoints (JSON unless noted; every error is ``{"error": "...", ...}`` with a
4xx status, never a 500 for bad input; bodies are capped by
``client_max_size = settings.max_body_bytes``):

- ``GET /healthz``: the process serves (200).
- ``GET /readyz``: store, data plane and control ports are up (200) or not (503).
- ``GET /metrics``: Prometheus text of the sidecar's own registry.
- ``POST /v1/handshake``: ``{"step": "hello", ...}`` then ``{"step": "proof",
  ...}`` (peers/handshake.py). Nothing about the pool is said before the
  peer proved the pool key; a key holder with another config gets 403 with
  ``reason``, the differing field names and the field diff (no secret).
- ``POST /v1/publish``, ``POST /v1/locate``: the chunk directory's messages
  (``location_routes.py``, ``peers/location.py``) for a peer with an inbound
  session; headers ``X-KV-Offload-Session`` and ``X-KV-Offload-Auth`` (an HMAC
  of the body with the session key). 401 otherwise.
- Admin (``Authorization: Bearer <token>``: the pool's admin token or the one
  derived from the pool key, ``kv-offload admin-token``; 401 otherwise, before
  the body is read, so a refused caller learns nothing):
  ``POST /v1/lookup`` ``{"keys": [hex, ...], "timeout": s}`` -> ``{"local",
  "peer"}`` (the engine lookup, for debugging; it moves no chunk); ``POST
  /v1/route`` ``{"keys": [hex, ...]}`` -> ``{"asked", "pods": [{"pod", "address",
  "chunks"}, ...]}``, the pods holding the longest prefixes of a request's chunk
  keys, longest first (routing hints for a gateway's endpoint picker; nothing
  moves); ``GET /v1/peers``, ``GET /v1/status``: what this sidecar knows and holds.
- Pod-local (the caller's address is 127.0.0.1, ::1 or the address it dialled,
  i.e. the pod's own network namespace; 403 otherwise): ``GET /v1/local``, the
  local channel socket path and the store's shm geometry for the engine
  client of this DP rank. Everything else the engine does goes over that
  Unix socket.

The apps hold no long-lived work: ``lifecycle.running`` starts and stops the
sidecar and the local channels around them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kv_offload_sidecar.control.location_routes import add_location_routes
from kv_offload_sidecar.engine.channel_protocol import MAX_TIMEOUT_SECONDS
from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES
from kv_offload_sidecar.metrics import metrics_handler
from kv_offload_sidecar.peers.handshake import HandshakeError, diff_fields

if TYPE_CHECKING:
    from kv_offload_sidecar.sidecar import Sidecar

log = logging.getLogger(__name__)

SIDECAR_KEY: web.AppKey[Sidecar] = web.AppKey("kv_offload_sidecar")
DP_INDEX_KEY: web.AppKey[int] = web.AppKey("kv_offload_dp_index", int)
# Most keys in one /v1/lookup body.
MAX_LOOKUP_KEYS = 4096

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Source addresses of the pod's own network namespace besides the dialled address.
LOOPBACK_SOURCES = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
ADMIN_HELP = ("send 'Authorization: Bearer <token>' with the pool's admin token (key 'admin-token' of "
              "the pool Secret) or the token 'kv-offload admin-token --pool-key-file <key file>' prints")


def admin_only(handler: Handler) -> Handler:
    """401 unless the request carries a valid admin bearer token (checked before the body)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sidecar = request.app[SIDECAR_KEY]
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not sidecar.keys.admin_allowed(token.strip()):
            sidecar.metrics.protocol_errors.labels(reason="unauthenticated").inc()
            return web.json_response({"error": f"{request.method} {request.path} is an admin endpoint: "
                                      f"{ADMIN_HELP}"}, status=401,
                                     headers={"WWW-Authenticate": 'Bearer realm="kv-offload"'})
        return await handler(request)

    return guarded


def pod_local(handler: Handler) -> Handler:
    """403 unless the caller is inside the pod (loopback, or the same address it dialled)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sidecar = request.app[SIDECAR_KEY]
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        own = sockname[0] if sockname else None
        if request.remote not in LOOPBACK_SOURCES and request.remote != own:
            sidecar.metrics.protocol_errors.labels(reason="unauthenticated").inc()
            return json_error(403, f"{request.method} {request.path} answers only inside the pod: the "
                              f"engine dials 127.0.0.1 or the pod IP (VLLM_P2P_SIDE_CHANNEL_HOST)")
        return await handler(request)

    return guarded


def json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn HTTP errors (404, 405, 413 ...) into JSON bodies with a clear message."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        sidecar = request.app[SIDECAR_KEY]
        sidecar.metrics.protocol_errors.labels(reason="oversize").inc()
        return json_error(413, f"request body exceeds {sidecar.settings.max_body_bytes} bytes: "
                          f"send a smaller body ({exc.text})")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.content_type == "application/json":  # ours, already a JSON error
            return web.Response(status=exc.status, text=exc.text, content_type="application/json")
        return json_error(exc.status, f"{request.method} {request.path}: {exc.reason}")


async def read_json(request: web.Request) -> Any:
    """The request body as JSON; raises HTTPBadRequest with a JSON message."""
    sidecar = request.app[SIDECAR_KEY]
    try:
        raw = await request.read()
    except web.HTTPException:
        raise
    except Exception as exc:  # truncated upload, reset connection
        sidecar.metrics.protocol_errors.labels(reason="malformed").inc()
        raise _bad(f"request body could not be read ({type(exc).__name__}): send the whole body") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        sidecar.metrics.protocol_errors.labels(reason="malformed").inc()
        raise _bad(f"request body is not valid JSON ({exc}): send a JSON object") from None


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


def parse_keys(value: Any, sidecar: Sidecar) -> list[bytes]:
    """A JSON list of hex chunk keys; HTTPBadRequest naming the problem."""
    if not isinstance(value, list):
        sidecar.metrics.protocol_errors.labels(reason="malformed").inc()
        raise _bad("'keys' must be a list of hex strings")
    if len(value) > MAX_LOOKUP_KEYS:
        sidecar.metrics.protocol_errors.labels(reason="oversize").inc()
        raise _bad(f"'keys' holds {len(value)} keys; at most {MAX_LOOKUP_KEYS} per request")
    keys: list[bytes] = []
    for i, item in enumerate(value):
        try:
            if not isinstance(item, str):
                raise ValueError
            key = bytes.fromhex(item)
        except ValueError:
            sidecar.metrics.protocol_errors.labels(reason="bad_key").inc()
            raise _bad(f"keys[{i}] is not a hex string") from None
        if not 0 < len(key) <= MAX_KEY_BYTES:
            sidecar.metrics.protocol_errors.labels(reason="bad_key").inc()
            raise _bad(f"keys[{i}] has {len(key)} bytes; keys have 1..{MAX_KEY_BYTES}")
        keys.append(key)
    return keys


def parse_timeout(value: Any, default: float) -> float:
    if value is None:
        return default
    limit = MAX_TIMEOUT_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= limit:
        raise _bad(f"'timeout' must be seconds in (0, {limit}], got {value!r}")
    return float(value)


# ---- handlers --------------------------------------------------------------------


async def handle_healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def handle_readyz(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    if sidecar.ready:
        return web.json_response({"status": "ready"})
    return json_error(503, "not ready: the sidecar is starting or shutting down")


async def handle_handshake(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    if not sidecar.ready:
        return json_error(503, "not ready: retry the handshake later")
    try:
        body = await read_json(request)
    except web.HTTPBadRequest as exc:
        sidecar.count_handshake_rejection(HandshakeError("malformed", "body is not JSON"),
                                          request.remote or "?")
        raise exc
    step = body.get("step") if isinstance(body, dict) else None
    try:
        if step == "hello":
            return web.json_response(sidecar.responder.hello(body))
        if step == "proof":
            session, reply = sidecar.responder.proof(body)
            sidecar.accept_session(session)
            return web.json_response(reply)
        raise HandshakeError("malformed", f"'step' must be 'hello' or 'proof', got {step!r}")
    except HandshakeError as exc:
        sidecar.count_handshake_rejection(exc, request.remote or "?")
        status = 400 if exc.reason == "malformed" else 403
        return json_error(status, str(exc), reason=exc.reason, fields=diff_fields(exc.diff),
                          diff=exc.diff)


def keys_handler(answer: Callable[[Sidecar, list[bytes], float], Awaitable[dict[str, Any]]]) -> Handler:
    """An admin handler of a ``{"keys": [hex, ...], "timeout": s}`` body: 503 until ready,
    400 naming what is wrong, else ``answer(sidecar, keys, timeout)`` as JSON."""

    @admin_only
    async def handle(request: web.Request) -> web.StreamResponse:
        sidecar = request.app[SIDECAR_KEY]
        if not sidecar.ready:
            return json_error(503, "not ready: the sidecar is starting or shutting down")
        body = await read_json(request)
        if not isinstance(body, dict):
            raise _bad("body must be an object {\"keys\": [hex, ...]}")
        keys = parse_keys(body.get("keys"), sidecar)
        timeout = parse_timeout(body.get("timeout"), sidecar.settings.fetch_deadline_seconds)
        return web.json_response(await answer(sidecar, keys, timeout))

    return handle


async def _lookup(sidecar: Sidecar, keys: list[bytes], timeout: float) -> dict[str, Any]:
    local, peer = await sidecar.lookup(keys, timeout, fetch=False)
    return {"local": local, "peer": peer}


async def _route(sidecar: Sidecar, keys: list[bytes], timeout: float) -> dict[str, Any]:
    return {"asked": len(keys), "pods": await sidecar.route_hint(keys, timeout)}


handle_lookup = keys_handler(_lookup)
handle_route = keys_handler(_route)


@admin_only
async def handle_peers(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    return web.json_response({"peers": sidecar.peers_view()})


@admin_only
async def handle_status(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    return web.json_response(sidecar.status())


@pod_local
async def handle_local(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    if not sidecar.ready:
        return json_error(503, "not ready: the store is not open yet")
    return web.json_response(sidecar.local_info(request.app[DP_INDEX_KEY]))


# ---- application ---------------------------------------------------------------


def create_app(sidecar: Sidecar, dp_index: int) -> web.Application:
    """The control application of one DP port (the sidecar runs already: ``lifecycle.running``)."""
    app = web.Application(client_max_size=sidecar.settings.max_body_bytes,
                          middlewares=[error_middleware])
    app[SIDECAR_KEY] = sidecar
    app[DP_INDEX_KEY] = dp_index
    app.router.add_get("/healthz", handle_healthz)
    app.router.add_get("/readyz", handle_readyz)
    app.router.add_get("/metrics", metrics_handler(sidecar.registry))
    app.router.add_post("/v1/handshake", handle_handshake)
    add_location_routes(app, SIDECAR_KEY)
    app.router.add_post("/v1/lookup", handle_lookup)
    app.router.add_post("/v1/route", handle_route)
    app.router.add_get("/v1/peers", handle_peers)
    app.router.add_get("/v1/status", handle_status)
    app.router.add_get("/v1/local", handle_local)
    return app
