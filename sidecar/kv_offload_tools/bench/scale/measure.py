"""What ``bench scale`` measures directly: object memory and the HTTP bytes around a message.

``deep_size(*objs)``: bytes of the objects and everything they reference
(``sys.getsizeof`` of each distinct object, numpy arrays with their data), the
way ``tracemalloc`` would count them (a test holds the two together).

``http_overhead()``: the bytes HTTP adds to one directory message on a kept-alive
connection, measured: a real aiohttp control app and a client set up as the
sidecar's ``PeerManager`` (same headers) talk through a counting TCP relay;
wire bytes minus body bytes, request and response apart. (The client skips and the handler
sends the same headers as the sidecar's: ``links.SKIPPED_REQUEST_HEADERS``,
``location_routes.REPLY_HEADERS``.)
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kv_offload_testing.http_client import serve_on_loopback

_ATOMIC = (int, float, str, bytes, bytearray, bool, type(None), complex)


def deep_size(*objs: Any) -> int:
    """Bytes of ``objs`` and of every object reachable from them, each counted once."""
    seen: set[int] = set()
    total = 0
    stack = list(objs)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or obj is True or obj is False:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            total += sys.getsizeof(obj) + (0 if obj.base is None else obj.nbytes)
            continue
        total += sys.getsizeof(obj)
        if isinstance(obj, _ATOMIC):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack.extend(obj)
        elif callable(obj) or isinstance(obj, type):
            continue
        else:
            slots = getattr(type(obj), "__slots__", ())
            stack.extend(getattr(obj, s) for s in slots if hasattr(obj, s))
            if hasattr(obj, "__dict__"):
                stack.append(vars(obj))
    return total


@dataclass(frozen=True)
class HttpOverhead:
    """Bytes HTTP adds to one message on a kept-alive connection."""

    # Request line and headers of a POST /v1/publish (session id and HMAC headers included).
    request: int
    # Status line and headers of the JSON reply.
    response: int


async def _measure(samples: int) -> HttpOverhead:
    import aiohttp
    from aiohttp import web
    from kv_offload_sidecar.control.location_routes import REPLY_HEADERS
    from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER, SKIPPED_REQUEST_HEADERS

    reply = json.dumps({"resync": False}, separators=(",", ":")).encode()

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=reply, content_type="application/json", headers=REPLY_HEADERS)

    app = web.Application()
    app.router.add_post("/v1/publish", handle)
    runner, port = await serve_on_loopback(app)
    counted = {"up": 0, "down": 0}

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str) -> None:
        try:
            while data := await reader.read(65536):
                counted[way] += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(reader, up_w, "up"), pipe(up_r, writer, "down"), return_exceptions=True)

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    relay_port = server.sockets[0].getsockname()[1]
    body = json.dumps({"epoch": "0" * 16, "seq": 1, "reset": False, "resync_me": False,
                       "adds": "A" * 16, "removes": ""}, separators=(",", ":")).encode()
    headers = {SESSION_HEADER: "00" * 16, AUTH_HEADER: "00" * 32, "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False,
                                     skip_auto_headers=SKIPPED_REQUEST_HEADERS) as http:
        for _ in range(samples + 1):  # the first one opens the connection
            if _ == 1:
                counted.update(up=0, down=0)
            async with http.post(f"http://127.0.0.1:{relay_port}/v1/publish", data=body, headers=headers) as r:
                await r.read()
    server.close()
    await runner.cleanup()
    return HttpOverhead(request=counted["up"] // samples - len(body),
                        response=counted["down"] // samples - len(reply))


def http_overhead(samples: int = 4) -> HttpOverhead:
    """Measure the HTTP bytes around one directory message (a few requests, averaged)."""
    return asyncio.run(_measure(samples))


def handshake_bytes(overhead: HttpOverhead) -> int:
    """Bytes of one handshake (both HTTP steps and the data connection's challenge), from the
    real initiator's and responder's bodies for the example config's hello."""
    from kv_offload_sidecar.data import protocol as proto
    from kv_offload_sidecar.data.base import auth_proof
    from kv_offload_sidecar.peers.handshake import HandshakeInitiator, HandshakeResponder, make_hello

    from kv_offload_testing.local_pool import example_config
    from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY

    config = example_config()

    def hello(identity: str) -> Any:
        return make_hello(fingerprint=config.fingerprint, hash_seed="0", kv_bytes_per_chunk=config.kv_bytes_per_chunk,
                          identity=identity, control_address="10.0.0.1:5710", data_address="tcp://10.0.0.1:5810",
                          transport="tcp", run_config=config.run_config(),
                          model_identity=STAND_IN_IDENTITY)

    key = b"bench-scale-pool-key"
    responder = HandshakeResponder(key, lambda: hello("pod-0"))
    initiator = HandshakeInitiator(key, hello("pod-1"))
    step1 = initiator.step1()
    reply1 = responder.hello(step1)
    step2 = initiator.step2(reply1)
    session, reply2 = responder.proof(step2)
    bodies = sum(len(json.dumps(b, separators=(",", ":"))) for b in (step1, reply1, step2, reply2))
    frames = [proto.encode_auth_challenge(b"\0" * proto.NONCE_BYTES),
              proto.encode_auth_response(session.session_id, auth_proof(session.session_key, b"n")),
              proto.encode_auth_ok()]
    wire = sum(len(part) for frame in frames for part in frame)
    return bodies + 2 * (overhead.request + overhead.response) + wire
