"""The control plane: one aiohttp application per DP port of the pod.

Endpoints (JSON unless noted; every error is ``{"error": "...", ...}`` with a
4xx status, never a 500 for bad input; bodies are capped at
``settings.network.max_body_bytes``, handshake bodies at ``MAX_HANDSHAKE_BODY_BYTES``, and
must arrive within ``request_limits.BODY_SECONDS``; JSON is parsed with
``rejections.loads_bounded``; what a caller may cost before it proves anything is
``limits.py``'s, and every refusal is counted in ``protocol_errors{reason}`` and noted
in one rate-limited ``RejectionLog``):

- ``GET /healthz``: the process serves (200).
- ``GET /readyz``: store, data plane and control ports are up (200) or not (503).
- ``GET /metrics``: Prometheus text of the sidecar's own registry.
- ``POST /v1/handshake``: ``{"step": "hello", ...}`` then ``{"step": "proof",
  ...}`` (peers/handshake.py). Nothing about the pool, its wire version
  included, is said before the peer proved the pool key; a key holder with
  another config gets 403 with ``reason``, the differing field names and the
  field diff (no secret).
- ``POST /v1/publish``, ``POST /v1/locate``: the chunk directory's messages
  (``control/location_routes.py``, ``peers/directory/location.py``) for a peer with an inbound
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

The apps hold no long-lived work. ``ControlPorts`` serves the app of every DP
port behind one ``limits.ConnectionGuard``; it runs inside ``lifecycle.running``
(the sidecar and the local channels are up around it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from kv_offload_sidecar.control.guarded_site import GuardedSite
from kv_offload_sidecar.control.limits import (
    GUARD_KEY,
    HANDSHAKE_BURST,
    UNPROVEN_REQUEST_SECONDS,
    ConnectionGuard,
    guard_middleware,
    mark_proven,
    rate_limited_answer,
)
from kv_offload_sidecar.control.request_limits import (
    REJECTIONS_KEY,
    SERVER_HEADER,
    BodyError,
    handler_args,
    read_body,
    source_of,
)
from kv_offload_sidecar.control.location_routes import add_location_routes
from kv_offload_sidecar.data.before_auth import TrustedSources, freeze_long_lived, thaw_long_lived
from kv_offload_sidecar.engine.channel_protocol import MAX_TIMEOUT_SECONDS
from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES
from kv_offload_sidecar.last_good_config import config_view
from kv_offload_sidecar.peers.handshake import (
    MAX_HANDSHAKE_BODY_BYTES,
    REASONS,
    HandshakeError,
    diff_fields,
)
from kv_offload_sidecar.rejections import clip, loads_bounded

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
# Handshake rejections a caller gets only after proving the pool key: their log line carries
# the field diff (a key holder's, bounded by the hello's field limits).
PROVEN_REJECTIONS = ("fingerprint_mismatch", "model_mismatch", "hash_seed_mismatch", "chunk_size_mismatch",
                     "wire_version_mismatch")
# Longest detail of a proven peer's rejection line (the field diff an operator needs).
PROVEN_DETAIL_CHARS = 2000
# Seconds between writes of the count lines of rejection-log windows that ended (a quarter of
# the sidecar's 60 s window).
REJECTION_FLUSH_SECONDS = 15.0


def refuse(request: web.Request, reason: str, detail: object = "") -> None:
    """Count one refusal in ``protocol_errors{reason}`` and note it in the rate-limited log."""
    request.app[SIDECAR_KEY].metrics.protocol_errors.labels(reason=reason).inc()
    request.app[REJECTIONS_KEY].reject(source_of(request), reason, detail)


def admin_only(handler: Handler) -> Handler:
    """401 unless the request carries a valid admin bearer token (checked before the body)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sidecar = request.app[SIDECAR_KEY]
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not sidecar.keys.admin_allowed(token.strip()):
            refuse(request, "unauthenticated", f"{request.method} {request.path} without the admin token")
            return web.json_response({"error": f"{request.method} {clip(request.path, 64)} is an admin "
                                      f"endpoint: {ADMIN_HELP}"}, status=401,
                                     headers={"WWW-Authenticate": 'Bearer realm="kv-offload"'})
        mark_proven(request)
        return await handler(request)

    return guarded


def pod_local(handler: Handler) -> Handler:
    """403 unless the caller is inside the pod (loopback, or the same address it dialled)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        own = sockname[0] if sockname else None
        if request.remote not in LOOPBACK_SOURCES and request.remote != own:
            refuse(request, "unauthenticated", f"{request.method} {request.path} from outside the pod")
            return json_error(403, f"{request.method} {request.path} answers only inside the pod: the "
                              f"engine dials 127.0.0.1 or the pod IP (VLLM_P2P_SIDE_CHANNEL_HOST)")
        mark_proven(request)
        return await handler(request)

    return guarded


def json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn HTTP errors (404, 405, 408, 413 ...) into JSON bodies with a clear message; a body
    refused by ``read_body`` also closes its connection (the rest of it is not read)."""
    try:
        return await handler(request)
    except BodyError as exc:
        refuse(request, exc.reason, f"{request.method} {request.path}: {exc}")
        resp = json_error(exc.status, str(exc))
        resp.force_close()
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.content_type == "application/json":  # ours, already a JSON error
            return web.Response(status=exc.status, text=exc.text, content_type="application/json")
        return json_error(exc.status, f"{request.method} {clip(request.path, 64)}: {exc.reason}")


async def read_json(request: web.Request, limit: int | None = None) -> Any:
    """The request body as JSON (``loads_bounded``), at most ``limit`` bytes (default
    ``settings.network.max_body_bytes``); BodyError (408, 413) or HTTPBadRequest with a JSON message."""
    sidecar = request.app[SIDECAR_KEY]
    try:
        raw = await read_body(request, sidecar.settings.network.max_body_bytes if limit is None else limit)
    except BodyError:
        raise
    except Exception as exc:  # truncated upload, reset connection
        refuse(request, "malformed", f"{request.path}: body unreadable ({type(exc).__name__})")
        raise _bad(f"request body could not be read ({type(exc).__name__}): send the whole body",
                   reason="malformed") from None
    try:
        return loads_bounded(raw)
    except ValueError as exc:
        refuse(request, "malformed", f"{request.path}: {exc}")
        raise _bad(f"request body is not valid JSON ({clip(exc)}): send a JSON object",
                   reason="malformed") from None


def _bad(message: str, **extra: Any) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message, **extra}),
                              content_type="application/json")


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
        raise _bad(f"'timeout' must be seconds in (0, {limit}], got {clip(repr(value), 64)}")
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
    guard = request.app.get(GUARD_KEY)
    if guard is not None and not guard.allow_handshake(request.remote or "?"):
        refuse(request, "rate_limited", f"more than {HANDSHAKE_BURST} handshakes in {UNPROVEN_REQUEST_SECONDS:g} s")
        return await rate_limited_answer()
    try:
        body = await read_json(request, MAX_HANDSHAKE_BODY_BYTES)
    except (BodyError, web.HTTPBadRequest):
        sidecar.metrics.handshakes.labels(result="rejected", reason="malformed").inc()
        raise
    step = body.get("step") if isinstance(body, dict) else None
    if not sidecar.model.known.is_set():  # it shares nothing yet: a wait, not a refusal
        return json_error(503, "not ready: this sidecar's engine has not stated its model "
                               "identity yet (vLLM is starting); try again later")
    try:
        if step == "hello":
            return web.json_response(sidecar.responder.hello(body))
        if step == "proof":
            session, reply = sidecar.responder.proof(body)
            mark_proven(request)
            sidecar.accept_session(session)
            return web.json_response(reply)
        raise HandshakeError("malformed", f"'step' must be 'hello' or 'proof', got {clip(repr(step), 64)}")
    except HandshakeError as exc:
        reason = exc.reason if exc.reason in REASONS else "malformed"
        sidecar.metrics.handshakes.labels(result="rejected", reason=reason).inc()
        if reason in PROVEN_REJECTIONS:  # a key holder: the operator needs the field diff
            request.app[REJECTIONS_KEY].reject(source_of(request), f"handshake {reason}",
                                               "; ".join([str(exc), *exc.diff]),
                                               detail_chars=PROVEN_DETAIL_CHARS)
        else:
            request.app[REJECTIONS_KEY].reject(source_of(request), f"handshake {reason}", exc)
        status = 400 if reason == "malformed" else 403
        return json_error(status, str(exc), reason=reason, fields=diff_fields(exc.diff),
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
        timeout = parse_timeout(body.get("timeout"), sidecar.settings.peers.fetch_deadline_seconds)
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
    # where the running config came from: the file, or the last good one (last_good_config)
    return web.json_response({**sidecar.status(), "config": config_view(sidecar.settings.pool.config_rejected)})


@pod_local
async def handle_local(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    if not sidecar.ready:
        return json_error(503, "not ready: the store is not open yet")
    return web.json_response(sidecar.local_info(request.app[DP_INDEX_KEY]))


# ---- application ---------------------------------------------------------------


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_HEADER


def create_app(sidecar: Sidecar, dp_index: int, *, guard: ConnectionGuard | None = None) -> web.Application:
    """The control application of one DP port (the sidecar runs already: ``lifecycle.running``).

    ``guard`` (``ControlPorts``'s) is told where requests start and end and which proved
    themselves; without one (an app served by a test client) only the per-request limits hold.
    """
    middlewares = [error_middleware] if guard is None else [guard_middleware(guard), error_middleware]
    app = web.Application(client_max_size=sidecar.settings.network.max_body_bytes, middlewares=middlewares,
                          handler_args=handler_args(sidecar.metrics, sidecar.rejections))
    app[SIDECAR_KEY] = sidecar
    app[DP_INDEX_KEY] = dp_index
    app[REJECTIONS_KEY] = sidecar.rejections
    if guard is not None:
        app[GUARD_KEY] = guard
    app.on_response_prepare.append(_server_header)
    app.router.add_get("/healthz", handle_healthz)
    app.router.add_get("/readyz", handle_readyz)
    app.router.add_get("/metrics", make_aiohttp_handler(registry=sidecar.registry))
    app.router.add_post("/v1/handshake", handle_handshake)
    add_location_routes(app, SIDECAR_KEY)
    app.router.add_post("/v1/lookup", handle_lookup)
    app.router.add_post("/v1/route", handle_route)
    app.router.add_get("/v1/peers", handle_peers)
    app.router.add_get("/v1/status", handle_status)
    app.router.add_get("/v1/local", handle_local)
    return app


class ControlPorts:
    """The control app of every DP port of ``sidecar`` (started: its data server exists),
    behind one ``ConnectionGuard`` whose refusals go to the sidecar's rejection log and whose
    trusted sources are the data server's (one budget of lines, one set of proven addresses).
    While they listen, what the sidecar held when they started is frozen out of the garbage
    collector (``before_auth.freeze_long_lived``): no collection a stranger provokes walks it."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar
        # The data server's trusted sources, so a proof on either port counts for both.
        trusted = getattr(sidecar.data_server, "trusted_sources", None)
        self.guard = ConnectionGuard(sidecar.metrics, sidecar.rejections,
                                     trusted if isinstance(trusted, TrustedSources) else None)
        self._runners: list[web.AppRunner] = []
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen on every control port (OSError when one is taken; those started stay up)."""
        s = self._sidecar.settings
        for idx in s.network.dp_indices:
            runner = web.AppRunner(create_app(self._sidecar, idx, guard=self.guard), handle_signals=False,
                                   access_log=None, shutdown_timeout=s.process.shutdown_grace_seconds)
            await runner.setup()
            self._runners.append(runner)
            await GuardedSite(runner, s.network.host, s.network.control_port(idx), self.guard).start()
        self._flusher = asyncio.create_task(self._flush_rejections(), name="rejection log")
        freeze_long_lived()  # the last part of the sidecar is up

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish (``shutdown_grace_seconds``), close."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        while self._runners:
            await self._runners.pop().cleanup()
        self.guard.rejections.flush()
        thaw_long_lived()

    async def _flush_rejections(self) -> None:
        """Write each window's ``... and N more`` line when it ends, even if no rejection follows."""
        while True:
            await asyncio.sleep(REJECTION_FLUSH_SECONDS)
            self.guard.rejections.flush()
