"""Separate-process peers for the data-plane tests (run as a script, imported for helpers).

``python transport_peers.py serve --kind tcp|ucx ...`` fills a chunk store with
deterministic chunks, starts a data-plane server (TCP under TLS with ``--tls-cert-file``,
``--tls-key-file`` and ``--tls-ca-file``; its log to ``--log-file``), prints one JSON line
``{"address", "pid"}`` and then answers stdin commands: ``metrics`` prints the
server's counters and its unauthenticated connections as one JSON line, ``quit`` stops it.

``python transport_peers.py ucx-client --scenario NAME ...`` runs one UCX client
scenario (UCX reads its environment once, so every UCX client is its own
process) and prints its outcome as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

SESSION_ID = b"session-1"
SESSION_KEY = b"k" * 32


def key_of(i: int) -> bytes:
    """vLLM-shaped chunk key: a 32-byte hash + the group index as 4 bytes."""
    return hashlib.sha256(f"chunk-{i}".encode()).digest() + (i % 3).to_bytes(4, "big")


def content_of(i: int, size: int) -> bytes:
    """The deterministic bytes of chunk ``i``."""
    import numpy as np

    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def _configure_ucx(tls: str, lanes: int) -> None:
    from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env

    configure_ucx_env(tls, net_devices="lo" if "tcp" in tls else None, lanes=lanes)


def _metrics_snapshot(metrics: Any, server: Any) -> dict[str, Any]:
    from kv_offload_sidecar.metrics import PROTOCOL_ERROR_REASONS

    return {
        "protocol_errors": {r: metrics.protocol_errors.labels(reason=r)._value.get()
                            for r in PROTOCOL_ERROR_REASONS},
        "peer_bytes_sent": metrics.peer_bytes.labels(direction="sent")._value.get(),
        "unauthenticated": server.unauthenticated,
        "memory_reclaims": server.memory_reclaims,
    }


def hold_chunks(store: Any, n: int, chunk_bytes: int) -> None:
    """Commit chunk i (``content_of(i)`` under ``key_of(i)``) for i < n into ``store``."""
    for i in range(n):
        res = store.begin_write(key_of(i))
        assert res is not None
        res.view[:] = content_of(i, chunk_bytes)
        res.commit()


async def serve(args: argparse.Namespace) -> None:
    from kv_offload_sidecar.data import make_server
    from kv_offload_sidecar.engine.store_view import slot_stride_for
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.store.chunk_store import ChunkStore
    from prometheus_client import CollectorRegistry

    metrics = SidecarMetrics(CollectorRegistry())
    store = ChunkStore(args.chunk_bytes, (args.chunks + 1) * slot_stride_for(args.chunk_bytes),
                       directory=args.shm_dir, name=f"srv-{os.getpid()}", metrics=metrics)
    corrupt = {int(x) for x in args.corrupt.split(",") if x}
    hold_chunks(store, args.chunks, args.chunk_bytes)
    for i in sorted(corrupt):  # flip bytes after the checksum was taken
        if i < args.chunks:
            pin = store.pin(key_of(i))
            assert pin is not None
            store.slot_view(pin.slot)[:8] = b"CORRUPT!"
            pin.release()

    sessions = {SESSION_ID: SESSION_KEY}

    def authorize(session_id: bytes) -> bytes | None:
        return sessions.get(session_id)

    context = None
    if args.tls_cert_file:
        from kv_offload_sidecar.data.tls import server_context

        context = server_context(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
    server = make_server(args.kind, store, authorize, metrics, host="127.0.0.1", port=0,
                         chunk_bytes=args.chunk_bytes, auth_timeout=args.auth_timeout, ssl=context)
    address = await server.start()
    print(json.dumps({"address": address, "pid": os.getpid()}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            cmd = line.strip()
            if cmd == "metrics":
                print(json.dumps(_metrics_snapshot(metrics, server)), flush=True)
            elif cmd == "end_sessions":  # every session ends (e.g. its pool key was retired)
                sessions.clear()
                print(json.dumps({"sessions": 0}), flush=True)
            elif cmd == "nixl":
                from kv_offload_sidecar.data.nixl.exports import (
                    dark_views,
                    exported_views,
                    live_views,
                )

                runtime = getattr(server, "_runtime", None)
                print(json.dumps({"live_views": live_views(), "exported_views": exported_views(),
                                  "dark_views": dark_views(),
                                  "leased": server.leased, "pinned": store.stats()["pinned"],
                                  "serving_hot_until": runtime.serving_hot_until if runtime else 0.0}),
                      flush=True)
            elif cmd in ("quit", ""):
                break
    finally:
        await server.stop(0.5)
        store.close()


@contextlib.asynccontextmanager
async def session(address: str, timeout: float = 5, **connect_options: Any) -> AsyncIterator[Any]:
    """A client of the peer at ``address`` that proved the test session, closed on leaving
    (``connect_options``: ``metrics``, ``ssl``)."""
    from kv_offload_sidecar.data import connect

    client = await connect(address, SESSION_ID, SESSION_KEY, timeout=timeout, **connect_options)
    try:
        yield client
    finally:
        await client.close()


async def assert_still_serves(address: str, store: Any, **connect_options: Any) -> None:
    """An authenticated client of the peer at ``address`` still fetches the two chunks it holds."""
    async with session(address, **connect_options) as client:
        assert await client.fetch([key_of(0), key_of(1)], store, timeout=5) == 2


async def connect_and_fetch(address: str, store: Any, keys: list[bytes], chunk_bytes: int,
                            connect_timeout: float) -> tuple[Any, dict[str, Any]]:
    """A client connected to ``address`` (left open) and what it saw: its lookups (all held; a
    gap after 3), its fetch of ``keys`` (identical to what the peer holds?) and a fetch of a key
    nobody holds."""
    from kv_offload_sidecar.data import connect

    client = await connect(address, SESSION_ID, SESSION_KEY, timeout=connect_timeout)
    return client, {
        "lookup_all": await client.lookup(keys + [key_of(10_000)], timeout=5),
        "lookup_gap": await client.lookup(keys[:3] + [key_of(10_000)] + keys[3:], timeout=5),
        "fetched": await client.fetch(keys, store, timeout=20),
        "identical": all(chunk_bytes_in(store, k) == content_of(i, chunk_bytes) for i, k in enumerate(keys)),
        "fetch_missing": await client.fetch([key_of(10_000)], store, timeout=5),
    }


Scenario = Callable[[argparse.Namespace, list[bytes], Any], Awaitable[dict[str, Any]]]


async def client_scenario(args: argparse.Namespace, store_name: str, connect_timeout: float,
                          after_fetch: Callable[[Any, list[bytes]], Awaitable[dict[str, Any]]],
                          more: Mapping[str, Scenario]) -> dict[str, Any]:
    """The fetching side of ``args.scenario``, with what it left in its store: the scenarios every
    transport runs (fetch, bad_auth, kill, corrupt) or one of the transport's own ``more``."""
    from kv_offload_sidecar.data import TransportError, connect

    store, keys, stride, killed = client_store(args, store_name)
    out: dict[str, Any] = {"scenario": args.scenario}
    try:
        if args.scenario == "fetch":
            client, seen = await connect_and_fetch(args.address, store, keys, args.chunk_bytes, connect_timeout)
            out.update(seen)
            out.update(await after_fetch(client, keys))
            await client.close()
        elif args.scenario == "bad_auth":
            t0 = time.monotonic()
            try:
                await connect(args.address, SESSION_ID, b"wrong-key", timeout=5)
                out["error"] = None
            except TransportError as exc:
                out["error"] = str(exc)
            out["elapsed"] = time.monotonic() - t0
        elif args.scenario in ("kill", "corrupt"):
            client = await connect(args.address, SESSION_ID, SESSION_KEY, timeout=connect_timeout)
            out.update(await kill_or_corrupt(args, client, keys, store, killed))
        elif args.scenario in more:
            out.update(await more[args.scenario](args, keys, store))
        else:
            raise SystemExit(f"unknown scenario {args.scenario!r}")
        out.update(leftovers(args, keys, store, stride))
    finally:
        store.close()
    return out


async def ucx_client(args: argparse.Namespace) -> dict[str, Any]:
    async def lanes(client: Any, keys: list[bytes]) -> dict[str, Any]:
        from kv_offload_sidecar.peers.liveness import lanes_of

        # A heartbeat on every connection the links' liveness pings (the partner lane too).
        pongs = [await c.ping(5.0) for c in lanes_of(client)]
        return {"lane_chunks": list(client.lane_chunks), "chunk_replies": list(client.chunk_replies),
                "heartbeats_answered": len(pongs)}

    async def before_auth(args: argparse.Namespace, keys: list[bytes], store: Any) -> dict[str, Any]:
        return await _before_auth(args)

    return await client_scenario(args, "cli", 10, lanes, {"garbage": _garbage, "before_auth": before_auth})


async def _garbage(args: argparse.Namespace, keys: list[bytes], store: Any) -> dict[str, Any]:
    """Bad UCX clients: junk on the attach tag, a wrong MAC, an oversized frame, an unknown type.

    Afterwards a well-behaved client must still fetch everything.
    """
    from kv_offload_sidecar.data import connect
    from kv_offload_sidecar.data import protocol as proto
    from kv_offload_sidecar.data.ucx import frames as ucx
    from kv_offload_sidecar.data.ucx.runtime import UcxRuntime

    rt = UcxRuntime.get()
    server = ucx.decode_address(args.address)
    out: dict[str, Any] = {}
    ep = rt.endpoint(server)
    await rt.send(ep, bytearray(b"junk" * 10), ucx.ATTACH_TAG)
    bad_mac = proto.encode_ucx_attach(777, SESSION_ID, bytes(32), rt.address)
    await rt.send(ep, bytearray(proto.join(bad_mac)), ucx.ATTACH_TAG)

    async def raw_session(cid: int) -> tuple[int, int]:
        mac = ucx.attach_mac(SESSION_KEY, cid, rt.address)
        await rt.send(ep, bytearray(proto.join(proto.encode_ucx_attach(cid, SESSION_ID, mac, rt.address))),
                      ucx.ATTACH_TAG)
        c2s, s2c = ucx.tag(cid, ucx.TAG_C2S), ucx.tag(cid, ucx.TAG_S2C)
        buf = bytearray(ucx.CONTROL_BUFFER_BYTES)
        await rt.recv(ep, buf, s2c)
        nonce = bytes(buf[proto.HEADER_BYTES:proto.HEADER_BYTES + proto.NONCE_BYTES])
        from kv_offload_sidecar.data.base import auth_proof

        answer = proto.encode_auth_response(SESSION_ID, auth_proof(SESSION_KEY, nonce))
        await rt.send(ep, bytearray(proto.join(answer)), c2s)
        await rt.recv(ep, buf, s2c)
        return c2s, s2c

    async def error_reply(s2c: int) -> str:
        buf = bytearray(ucx.CONTROL_BUFFER_BYTES)
        async with asyncio.timeout(5):
            await rt.recv(ep, buf, s2c)
        header = proto.decode_header(buf[:proto.HEADER_BYTES])
        return f"{header.type.name} " + proto.decode_error(
            buf[proto.HEADER_BYTES:proto.HEADER_BYTES + header.length])

    c2s, s2c = await raw_session(1001)
    await rt.send(ep, bytearray(2 * ucx.CONTROL_BUFFER_BYTES), c2s)  # oversized frame
    out["oversize_reply"] = await error_reply(s2c)
    c2s, s2c = await raw_session(1002)
    junk = bytearray(proto.HEADER.pack(proto.MAGIC, proto.WIRE_MAJOR, 99, 0, 0))
    await rt.send(ep, junk, c2s)  # unknown message type
    out["unknown_type_reply"] = await error_reply(s2c)
    c2s, s2c = await raw_session(1003)
    await rt.send(ep, bytearray(proto.join(proto.encode_fetch(1, [b"k"])))[:-1], c2s)  # truncated
    out["truncated_reply"] = await error_reply(s2c)

    client = await connect(args.address, SESSION_ID, SESSION_KEY, timeout=10)
    out["fetched_after"] = await client.fetch(keys, store, timeout=20)
    out["identical_after"] = all(chunk_bytes_in(store, k) == content_of(i, args.chunk_bytes)
                                 for i, k in enumerate(keys))
    await client.close()
    return out


async def _before_auth(args: argparse.Namespace) -> dict[str, Any]:
    """What an attached client may cost before its proof: a 4 KiB AUTH_RESPONSE is refused
    (ERROR oversize); then ``MAX_UNPROVEN_PER_SOURCE`` attaches of one session that never
    answer their challenge, and one more, which the server refuses. Prints ``{"held": n}`` once
    they are held and keeps them until a line arrives on stdin (the test reads the server's
    counters meanwhile)."""
    from kv_offload_sidecar.data import protocol as proto
    from kv_offload_sidecar.data.before_auth import MAX_UNPROVEN_PER_SOURCE
    from kv_offload_sidecar.data.ucx import frames as ucx
    from kv_offload_sidecar.data.ucx.runtime import UcxRuntime

    rt = UcxRuntime.get()
    ep = rt.endpoint(ucx.decode_address(args.address))

    async def attach(cid: int) -> tuple[int, int]:
        mac = ucx.attach_mac(SESSION_KEY, cid, rt.address)
        await rt.send(ep, bytearray(proto.join(proto.encode_ucx_attach(cid, SESSION_ID, mac, rt.address))),
                      ucx.ATTACH_TAG)
        return ucx.tag(cid, ucx.TAG_C2S), ucx.tag(cid, ucx.TAG_S2C)

    async def reply(s2c: int) -> tuple[str, bytes]:
        buf = bytearray(ucx.CONTROL_BUFFER_BYTES)
        async with asyncio.timeout(10):
            await rt.recv(ep, buf, s2c)
        header = proto.decode_header(buf[:proto.HEADER_BYTES])
        return header.type.name, bytes(buf[proto.HEADER_BYTES:proto.HEADER_BYTES + header.length])

    out: dict[str, Any] = {}
    c2s, s2c = await attach(2001)
    kind, _ = await reply(s2c)
    assert kind == "AUTH_CHALLENGE", kind
    await rt.send(ep, bytearray(proto.join(proto.encode_auth_response(SESSION_ID, bytes(32)))) + bytes(4096), c2s)
    kind, text = await reply(s2c)
    out["big_proof_reply"] = f"{kind} {text.decode()}"
    held = 0
    for cid in range(3001, 3001 + MAX_UNPROVEN_PER_SOURCE):
        _, s2c = await attach(cid)
        kind, _ = await reply(s2c)
        held += kind == "AUTH_CHALLENGE"
    await attach(3001 + MAX_UNPROVEN_PER_SOURCE)  # one more of the same session: refused
    print(json.dumps({"held": held}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    rt.abort(ep)
    return out


def client_store(args: argparse.Namespace, name: str) -> tuple[Any, list[bytes], int, dict[str, bool]]:
    """A client scenario's store, its keys and slot stride, and ``killed``: in the kill scenario
    the first chunk that lands SIGKILLs the server (``killed["done"]`` says it happened)."""
    from kv_offload_sidecar.engine.store_view import slot_stride_for
    from kv_offload_sidecar.store.chunk_store import ChunkStore

    stride = slot_stride_for(args.chunk_bytes)
    killed = {"done": False}

    def on_change(key: bytes, present: bool) -> None:
        if args.scenario == "kill" and present and not killed["done"]:
            killed["done"] = True
            os.kill(args.server_pid, signal.SIGKILL)

    store = ChunkStore(args.chunk_bytes, (args.chunks + 2) * stride, directory=args.shm_dir,
                       name=f"{name}-{os.getpid()}", on_change=on_change)
    return store, [key_of(i) for i in range(args.chunks)], stride, killed


async def kill_or_corrupt(args: argparse.Namespace, client: Any, keys: list[bytes], store: Any,
                          killed: dict[str, bool]) -> dict[str, Any]:
    """The kill scenario (the server dies as the first chunk lands) or the corrupt one (the
    server sends the ``--corrupt`` chunks damaged): what the fetch gave and where it stopped."""
    from kv_offload_sidecar.data import IntegrityError, TransportError

    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        out["fetched"] = await client.fetch(keys, store, timeout=3 if args.scenario == "kill" else 20)
        out["error"] = None
    except IntegrityError as exc:
        out["error"] = "integrity: " + str(exc)
    except TransportError as exc:
        out["error"] = str(exc)
    if args.scenario == "kill":
        out["elapsed"] = time.monotonic() - t0
        out["killed"] = killed["done"]
    else:
        out["corrupt_visible"] = any(store.contains(keys[int(i)]) for i in args.corrupt.split(","))
    return out


def leftovers(args: argparse.Namespace, keys: list[bytes], store: Any, stride: int) -> dict[str, Any]:
    """What every scenario must leave: each visible chunk byte-identical, no slot held."""
    visible = store.keys()
    held = 0  # slots a failed UCX connection keeps while the holder may still write them
    if "ucxx" in sys.modules:
        from kv_offload_sidecar.data.ucx.client import slots_held_after_failure

        held = slots_held_after_failure()
    return {"visible": len(visible), "held_after_failure": held,
            "visible_intact": all(chunk_bytes_in(store, k) == content_of(keys.index(k), args.chunk_bytes)
                                  for k in visible),
            "slots_in_use": store.used_bytes // stride}


def assert_nothing_partial(store: Any, chunk_bytes: int) -> None:
    """Every visible chunk is byte-identical to its source; no slot is held by a write."""
    keys = {key_of(i): i for i in range(200)}
    for key in store.keys():
        assert chunk_bytes_in(store, key) == content_of(keys[key], chunk_bytes)
    assert store.used_bytes == len(store) * store.slot_stride


def kill_at_first_chunk(pid: int) -> Callable[[bytes, bool], None]:
    """A store's ``on_change``: SIGKILL process ``pid`` when the first chunk becomes visible."""
    killed: list[bool] = []

    def on_change(key: bytes, present: bool) -> None:
        if present and not killed:
            killed.append(True)
            os.kill(pid, signal.SIGKILL)

    return on_change


def chunk_bytes_in(store: Any, key: bytes) -> bytes:
    """The bytes of the visible chunk ``key`` of a ChunkStore (AssertionError when not visible)."""
    pin = store.pin(key)
    assert pin is not None, f"{key.hex()} is not visible"
    try:
        return bytes(pin.view)
    finally:
        pin.release()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "ucx-client"])
    parser.add_argument("--kind", default="tcp")
    parser.add_argument("--tls", default="sm,self")
    parser.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--corrupt", default="")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--address", default="")
    parser.add_argument("--scenario", default="fetch")
    parser.add_argument("--server-pid", type=int, default=0)
    parser.add_argument("--auth-timeout", type=float, default=5.0)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--tls-cert-file", default="")
    parser.add_argument("--tls-key-file", default="")
    parser.add_argument("--tls-ca-file", default="")
    parser.add_argument("--log-file", default="")
    args = parser.parse_args()
    if args.log_file:
        import logging

        logging.basicConfig(filename=args.log_file, level=logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    if args.kind == "ucx" or args.mode == "ucx-client":
        _configure_ucx(args.tls, args.lanes)
    if args.mode == "serve":
        asyncio.run(serve(args))
    else:
        print(json.dumps(asyncio.run(ucx_client(args))), flush=True)


if __name__ == "__main__":
    main()
