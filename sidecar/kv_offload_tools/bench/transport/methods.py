"""The methods of ``kv-offload bench transport``, each a server process and a client process.

``transport.py`` starts a server and a client per method and chunk size
(``python -m kv_offload_tools.bench.transport.methods --role server|client``);
they talk JSON lines over stdin/stdout. A server holds two sets of chunks
and prints its address; a client connects, warms up, prints ``ready`` and
then answers ``{"cmd": "fetch", "seconds"}`` with GB/s, the bytes moved, its
CPU-seconds and whether the last set arrived byte-identical, and ``{"cmd": "rtt"}``
with lookup and raw round trips (the sidecar's TCP transport also with lookups while its
fetches stream: ``loaded_us``). Every worker answers ``{"cmd": "cpu"}`` with the
CPU-seconds its process has used (all threads). The methods:

- ``raw_tcp``: the limit: blocking ``sendall`` / ``recv_into`` a preallocated buffer;
  ``raw_tcp_2streams`` / ``raw_tcp_4streams`` / ``raw_tcp_8streams``: the same over 2 / 4 / 8
  connections at once (a
  fetch's chunks split between them, each received on its own thread).
- ``memcpy``: one core copying (``numpy.copyto``), in one process.
- ``tcp``: the sidecar's TCP transport, a peer fetch into store slots, checksums verified.
- ``tcp_2lanes`` / ``tcp_4lanes`` / ``tcp_8lanes``: the TCP transport with 2 / 4 / 8 lanes
  (``data.lanes``).
- ``tcp+tls``: the same over mutual TLS 1.3 (``--tls-dir`` holds a throw-away pool CA,
  ``server.crt``/``.key`` and ``client.crt``/``.key``; ``kv_offload_testing.certs``);
  ``tls_2lanes``: under TLS with 2 lanes.
- ``ucx_sm`` / ``ucx_tcp``: the sidecar's UCX transport with ``UCX_TLS=sm,self`` / ``tcp,self``
  (one lane: the holder copies every chunk, the default).
- ``ucx_sm_2lanes``: the UCX transport over ``sm`` with two lanes (``--lanes 2``: every
  third chunk is copied by the fetcher, so both processes' cores copy).
- ``ucx_sm_limit``: bare ucxx between busy-polling processes, two lanes, every chunk
  hashed on arrival (``ucx_limit.py``): what any ucxx data plane that verifies its
  chunks can reach here; the gap to ``ucx_sm_2lanes`` is the transport's overhead.
- ``ucx_sm_tagsend``: bare ucxx, one lane, nothing verified: plain UCX tag send/recv over CMA.
- ``aiohttp_get``: the naive baseline, one HTTP GET per chunk, copied into a slot, verified.
- ``nixl``, ``nixl_unverified``, ``nixl_bare``: one-sided NIXL READs (``nixl_methods.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from kv_offload_tools.bench.transport.nixl_methods import NIXL_METHODS
from kv_offload_testing.http_client import serve_on_loopback

# Methods measured, in the order of the table.
METHODS = ("raw_tcp", "memcpy", "tcp", "tcp+tls", "raw_tcp_2streams", "tcp_2lanes", "tls_2lanes", "raw_tcp_4streams",
           "tcp_4lanes", "raw_tcp_8streams", "tcp_8lanes", "ucx_sm", "ucx_sm_2lanes", "ucx_sm_limit", "ucx_sm_tagsend",
           "ucx_tcp", "aiohttp_get", *NIXL_METHODS)
# Raw TCP methods: method -> streams (a fetch's chunks split over that many connections, each
# received on a thread of its own).
RAW_STREAMS = {"raw_tcp": 1, "raw_tcp_2streams": 2, "raw_tcp_4streams": 4, "raw_tcp_8streams": 8}
# The sidecar's TCP transport with lanes (``data.lanes``): method -> lanes.
TCP_LANES = {"tcp_2lanes": 2, "tcp_4lanes": 4, "tcp_8lanes": 8, "tls_2lanes": 2}
# Each laned row against raw TCP with as many streams, in the same round.
LANES_TWIN = {"tcp_2lanes": "raw_tcp_2streams", "tcp_4lanes": "raw_tcp_4streams", "tcp_8lanes": "raw_tcp_8streams",
              "tls_2lanes": "raw_tcp_2streams"}
# Each laned row's one-lane form (the scaling the lanes bring).
ONE_LANE = {"tcp_2lanes": "tcp", "tcp_4lanes": "tcp", "tcp_8lanes": "tcp", "tls_2lanes": "tcp+tls"}
# The TCP transport at 1, 2, 4 and 8 lanes, each beside raw TCP with as many streams (CPU per GB).
LANE_LADDER = ((1, "tcp", "raw_tcp"), (2, "tcp_2lanes", "raw_tcp_2streams"), (4, "tcp_4lanes", "raw_tcp_4streams"),
               (8, "tcp_8lanes", "raw_tcp_8streams"))
# Methods under TLS (their workers load the throw-away pool's certificates).
TLS_METHODS = ("tcp+tls", "tls_2lanes")
# Keys per lookup request.
LOOKUP_KEYS = 32
# Session of the benchmark's data connections.
SESSION_ID = b"bench"
# What each UCX method needs in its process environment (UCX reads it once per process).
UCX_TLS = {"ucx_sm": "sm,self", "ucx_sm_2lanes": "sm,self", "ucx_sm_limit": "sm,self",
           "ucx_sm_tagsend": "sm,self", "ucx_tcp": "tcp,self"}
# Bare-ucxx methods (ucx_limit.py): method -> (lanes, chunks hashed on arrival).
UCX_BARE = {"ucx_sm_limit": (2, True), "ucx_sm_tagsend": (1, False)}
# UCX lanes of each UCX method's client (see data.ucx.runtime.configure_ucx_env).
UCX_LANES = {"ucx_sm_2lanes": 2}
# Methods whose clients also time peer lookups.
LOOKUP_METHODS = ("tcp", "tcp+tls", "ucx_sm", "ucx_tcp", "nixl")
# The sidecar's TCP transport, plain and under TLS.
TCP_METHODS = ("tcp", "tcp+tls")
# Rows measured against another row of the same round besides raw TCP: method -> its plain twin.
PLAIN_TWIN = {"tcp+tls": "tcp", "nixl": "nixl_unverified"}
# Methods whose client is handed the raw TCP server's address too (``|``-separated).
RAW_ALONGSIDE = (*TCP_METHODS, *TCP_LANES, *UCX_TLS, "nixl", "nixl_unverified")


def parse_ucx_env(text: str) -> dict[str, str]:
    """``--ucx-env`` as a dict; ValueError naming the item that is not ``UCX_...=value``."""
    out = {}
    for item in (x.strip() for x in str(text or "").split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.startswith(("UCX_", "UCXPY_")):
            raise ValueError(f"--ucx-env item {item!r} must be UCX_NAME=value")
        out[key] = value
    return out


def worker_argv(role: str, method: str, chunk_bytes: int, set_bytes: int, shm_dir: str, session_key: str,
                address: str, ucx_env: str, tls_dir: str = "") -> list[str]:
    """The command line of one worker process."""
    return [sys.executable, "-m", "kv_offload_tools.bench.transport.methods", "--role", role,
            "--method", method, "--chunk-bytes", str(chunk_bytes), "--set-bytes", str(set_bytes),
            "--shm-dir", shm_dir, "--session-key", session_key, "--address", address,
            f"--ucx-env={ucx_env}", f"--tls-dir={tls_dir}"]


def main(argv: Sequence[str] | None = None) -> int:
    """One worker process (``python -m kv_offload_tools.bench.transport.methods``)."""
    parser = argparse.ArgumentParser(prog="kv-offload bench transport worker")
    parser.add_argument("--role", choices=("server", "client"), required=True)
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    parser.add_argument("--set-bytes", type=int, required=True, help="a whole number of chunks")
    parser.add_argument("--shm-dir", required=True)
    parser.add_argument("--session-key", required=True, help="hex")
    parser.add_argument("--address", default="", help="the server's (client role)")
    parser.add_argument("--ucx-env", default="")
    parser.add_argument("--tls-dir", default="", help="certs.pool_certificates(dir, ['server', 'client'])")
    return _worker_main(parser.parse_args(argv))


def _content(i: int, size: int) -> bytes:
    import numpy as np

    return np.random.default_rng((i + 1) * 1_000_003 + size).bytes(size)


def _key(i: int) -> bytes:
    import hashlib

    return hashlib.sha256(f"bench-{i}".encode()).digest() + (0).to_bytes(4, "big")


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker_main(args: argparse.Namespace) -> int:
    method = args.method
    if method in UCX_TLS:
        from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env

        tls = UCX_TLS[method]
        configure_ucx_env(tls, net_devices="lo" if tls.startswith("tcp") else None,
                          lanes=UCX_LANES.get(method, 1))
        os.environ.update(parse_ucx_env(args.ucx_env))
    if method in NIXL_METHODS:
        from kv_offload_tools.bench.transport.nixl_methods import prepare_worker

        prepare_worker(method)
    size = args.chunk_bytes
    chunks = args.set_bytes // size
    try:
        if args.role == "server":
            if method in RAW_STREAMS:
                _raw_server(size, chunks)
            elif method == "aiohttp_get":
                asyncio.run(_aiohttp_server(args, size, chunks))
            elif method in UCX_BARE or method == "nixl_bare":
                _bare_server(args, size, chunks)
            else:
                asyncio.run(_transport_server(args, size, chunks))
        else:
            asyncio.run(_client(args, size, chunks))
    except BrokenPipeError:
        pass
    return 0


_ANSWERED: dict[str, Any] = {}


def _command(line: str) -> dict[str, Any] | None:
    """The command on ``line``: None for ``quit``, ``_ANSWERED`` for ``cpu`` (answered here)."""
    cmd = json.loads(line)
    if cmd.get("cmd") == "quit":
        return None
    if cmd.get("cmd") == "cpu":
        _emit({"cpu_seconds": time.process_time()})
        return _ANSWERED
    return cmd


def _commands() -> Any:
    """Commands until ``quit``; ``cpu`` is answered here, for every kind of worker."""
    for line in sys.stdin:
        cmd = _command(line)
        if cmd is None:
            return
        if cmd is not _ANSWERED:
            yield cmd


async def _acommands() -> Any:
    """``_commands`` for workers running an event loop."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = _command(line)
        if cmd is None:
            return
        if cmd is not _ANSWERED:
            yield cmd


def _tls_context(args: argparse.Namespace, role: str) -> Any:
    """The worker's TLS context (``tcp+tls``), else None."""
    if args.method not in TLS_METHODS:
        return None
    from kv_offload_sidecar.data import tls

    make = tls.server_context if role == "server" else tls.client_context
    base = os.path.join(args.tls_dir, role)
    return make(base + ".crt", base + ".key", os.path.join(args.tls_dir, "ca.crt"))


def _source_store(args: argparse.Namespace, size: int, n: int) -> Any:
    """A store holding two sets of ``n`` chunks (fetches alternate between them)."""
    from kv_offload_sidecar.engine.store_view import slot_stride_for
    from kv_offload_sidecar.store.chunk_store import ChunkStore

    store = ChunkStore(size, 2 * n * slot_stride_for(size), directory=args.shm_dir,
                       name=f"bench-src-{os.getpid()}")
    for i in range(2 * n):
        res = store.begin_write(_key(i))
        res.view[:] = _content(i, size)
        res.commit()
    return store


def _raw_server(size: int, n: int) -> None:
    """Blocking sockets: per request of k chunks, ``sendall`` k views of a preallocated buffer."""
    pool = bytearray(b"".join(_content(i, size) for i in range(2 * n)))
    views = [memoryview(pool)[i * size:(i + 1) * size] for i in range(2 * n)]
    lsock = socket.create_server(("127.0.0.1", 0))
    _emit({"address": f"{lsock.getsockname()[0]}:{lsock.getsockname()[1]}"})

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn, contextlib.suppress(ConnectionError):  # a client that exits resets it: its end
            while True:
                req = conn.recv(64, socket.MSG_WAITALL)
                if len(req) < 8:
                    return
                k, first = struct.unpack_from("!QQ", req)
                if k == 0:  # echo: a 64-byte round trip
                    conn.sendall(req)
                    continue
                for i in range(first, first + k):
                    conn.sendall(views[i % (2 * n)])

    def accept() -> None:
        while True:
            conn, _ = lsock.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    for _ in _commands():
        pass


def _bare_server(args: argparse.Namespace, size: int, n: int) -> None:
    """The holder of a bare method (ucx_limit.py or nixl_methods.py): the store's chunks, pinned."""
    if args.method == "nixl_bare":
        from kv_offload_tools.bench.transport.nixl_methods import run_bare_server as run_server
    else:
        from kv_offload_tools.bench.transport.ucx_limit import run_server

    store = _source_store(args, size, n)
    pins = [store.pin(_key(i)) for i in range(2 * n)]
    run_server([p.view for p in pins if p is not None], _commands(), _emit)
    for p in pins:
        if p is not None:
            p.release()
    store.close()


async def _transport_server(args: argparse.Namespace, size: int, n: int) -> None:
    from kv_offload_sidecar.data import make_server

    store = _source_store(args, size, n)
    key = bytes.fromhex(args.session_key)
    kind = "ucx" if args.method in UCX_TLS else "nixl" if args.method in NIXL_METHODS else "tcp"
    server = make_server(kind, store, {SESSION_ID: key}.get, None, chunk_bytes=size,
                         ssl=_tls_context(args, "server"))
    _emit({"address": await server.start()})
    async for _ in _acommands():
        pass
    await server.stop(0.5)
    store.close()


async def _aiohttp_server(args: argparse.Namespace, size: int, n: int) -> None:
    from aiohttp import web

    store = _source_store(args, size, n)

    async def get_chunk(request: web.Request) -> web.StreamResponse:
        pin = store.pin(bytes.fromhex(request.match_info["key"]))
        if pin is None:
            raise web.HTTPNotFound()
        try:
            body = bytes(pin.view)
            checksum = pin.checksum
        finally:
            pin.release()
        return web.Response(body=body, headers={"X-Checksum": str(checksum)})

    app = web.Application()
    app.router.add_get("/chunk/{key}", get_chunk)
    runner, port = await serve_on_loopback(app)
    _emit({"address": f"http://127.0.0.1:{port}"})
    async for _ in _acommands():
        pass
    await runner.cleanup()
    store.close()


async def _client(args: argparse.Namespace, size: int, n: int) -> None:
    """Answers {"cmd": "fetch", "seconds"} with GB/s and {"cmd": "rtt"} with round trips."""
    import xxhash

    method = args.method
    expected = [xxhash.xxh3_64_intdigest(_content(i, size)) for i in range(2 * n)]
    fetcher = await _make_fetcher(method, args, size, n, expected)
    try:
        for s in (0, 1):  # warm up: connect, fault every slot in
            await fetcher.fetch_set(s)
        ucx = ({k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
               if method in UCX_TLS else {})
        _emit({"ready": True, "ucx": ucx})
        # A command runs alone; between commands (the other methods' turns, many seconds
        # in a full run) heartbeats keep the client's connections, as a sidecar's links do.
        turn = asyncio.Lock()
        pinger = asyncio.create_task(_heartbeats(fetcher, turn))
        try:
            async for cmd in _acommands():
                if pinger.done():  # a connection went silent between commands: the worker ends
                    pinger.result()  # with that error, which the orchestrator reports
                async with turn:
                    s = await _serve_command(cmd, fetcher, n, size, expected, s)
        finally:
            pinger.cancel()
    except Exception as exc:
        _emit({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        await fetcher.close()


async def _heartbeats(fetcher: Any, turn: asyncio.Lock) -> None:
    """A heartbeat on each of ``fetcher``'s connections every ``HEARTBEAT_SECONDS`` while no
    command runs: a holder closes a connection silent for ``serving.SILENT_CLOSE_SECONDS``."""
    from kv_offload_sidecar.peers.liveness import HEARTBEAT_SECONDS

    keep_alive = getattr(fetcher, "keep_alive", None)
    while keep_alive is not None:
        await asyncio.sleep(HEARTBEAT_SECONDS)
        async with turn:
            await keep_alive()


async def _serve_command(cmd: dict[str, Any], fetcher: Any, n: int, size: int, expected: list[int],
                         s: int) -> int:
    """One command of the orchestrator's, its answer emitted; ``s``: the set the store holds
    (fetched last), returned as it is after the command."""
    if cmd["cmd"] == "fetch":
        moved, t0, cpu0 = 0, time.perf_counter(), time.process_time()
        while True:  # alternate sets: the store holds one, so every chunk is absent
            s ^= 1
            await fetcher.fetch_set(s)
            moved += n * size
            if time.perf_counter() - t0 >= cmd["seconds"]:
                break
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        ok = fetcher.digests(s) == expected[s * n:(s + 1) * n]
        _emit({"gbps": moved / elapsed / 1e9, "bytes": moved, "cpu_seconds": cpu, "identical": ok})
    elif cmd["cmd"] == "rtt":
        lookup_us, raw_us = await fetcher.round_trips(cmd["seconds"])
        loaded = getattr(fetcher, "loaded_round_trips", None)
        _emit({"us": lookup_us, "raw_us": raw_us,
               "loaded_us": await loaded(cmd["seconds"]) if loaded is not None else []})
    return s


async def _make_fetcher(method: str, args: argparse.Namespace, size: int, n: int,
                        expected: list[int]) -> Any:
    if method in RAW_STREAMS:
        return _RawFetcher(args.address, size, n, RAW_STREAMS[method])
    if method in UCX_BARE:
        from kv_offload_tools.bench.transport.ucx_limit import UcxLimitFetcher

        lanes, verify = UCX_BARE[method]
        return UcxLimitFetcher(args, size, n, expected, lanes=lanes, verify=verify)
    if method == "nixl_bare":
        from kv_offload_tools.bench.transport.nixl_methods import NixlBareFetcher

        return NixlBareFetcher(args, size, n)
    if method == "memcpy":
        return _MemcpyFetcher(size, n)
    if method == "aiohttp_get":
        f = _AiohttpFetcher(args, size, n)
        await f.open()
        return f
    f2 = _TransportFetcher(args, size, n)
    await f2.open()
    return f2


def _echo_once(sock: socket.socket) -> float:
    """One raw 64-byte round trip (microseconds) to the raw server's echo."""
    buf = bytearray(64)
    t0 = time.perf_counter()
    sock.sendall(bytes(64))
    got = 0
    while got < 64:
        k = sock.recv_into(memoryview(buf)[got:])
        if not k:
            raise ConnectionError("raw echo server closed")
        got += k
    return (time.perf_counter() - t0) * 1e6


class _RawFetcher:
    """The limit: blocking ``recv_into`` a preallocated pool, no checksum, no bookkeeping;
    with ``streams`` > 1 the set is split into that many runs, each requested and received on
    its own connection and thread."""

    def __init__(self, address: str, size: int, n: int, streams: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor

        host, port = address.rsplit(":", 1)
        self.socks = [socket.create_connection((host, int(port))) for _ in range(streams)]
        for sock in self.socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size, self.n = size, n
        self.pool = bytearray(size * n)
        self.views = [memoryview(self.pool)[i * size:(i + 1) * size] for i in range(n)]
        self.runs = [range(j * n // streams, (j + 1) * n // streams) for j in range(streams)]
        self.threads = ThreadPoolExecutor(streams) if streams > 1 else None

    def _fetch_run(self, sock: socket.socket, s: int, run: range) -> None:
        sock.sendall(struct.pack("!QQ", len(run), s * self.n + run.start).ljust(64, b"\0"))
        for i in run:
            v, got = self.views[i], 0
            while got < self.size:
                k = sock.recv_into(v[got:], self.size - got)
                if not k:
                    raise ConnectionError("raw server closed")
                got += k

    async def fetch_set(self, s: int) -> None:
        if self.threads is None:
            self._fetch_run(self.socks[0], s, self.runs[0])
            return
        for f in [self.threads.submit(self._fetch_run, sock, s, run) for sock, run in zip(self.socks, self.runs)]:
            f.result()

    def digests(self, s: int) -> list[int]:
        import xxhash

        return [xxhash.xxh3_64_intdigest(v) for v in self.views]

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        return [], []

    async def close(self) -> None:
        for sock in self.socks:
            sock.close()
        if self.threads is not None:
            self.threads.shutdown()


class _MemcpyFetcher:
    """One core copying chunk-sized buffers (numpy.copyto)."""

    def __init__(self, size: int, n: int) -> None:
        import numpy as np

        self.np = np
        self.size, self.n = size, n
        self.src = [np.frombuffer(_content(i, size), dtype=np.uint8) for i in range(2 * n)]
        self.dst = np.zeros((n, size), dtype=np.uint8)

    async def fetch_set(self, s: int) -> None:
        for i in range(self.n):
            self.np.copyto(self.dst[i], self.src[s * self.n + i])

    def digests(self, s: int) -> list[int]:
        import xxhash

        return [xxhash.xxh3_64_intdigest(self.dst[i]) for i in range(self.n)]

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        return [], []

    async def close(self) -> None:
        pass


class _StoreFetcher:
    """Shared part of the fetchers that land chunks in a real chunk store."""

    def __init__(self, args: argparse.Namespace, size: int, n: int) -> None:
        from kv_offload_sidecar.engine.store_view import slot_stride_for
        from kv_offload_sidecar.store.chunk_store import ChunkStore

        self.size, self.n = size, n
        self.store = ChunkStore(size, n * slot_stride_for(size), directory=args.shm_dir,
                                name=f"bench-dst-{os.getpid()}")
        self.keys = [_key(i) for i in range(2 * n)]

    def digests(self, s: int) -> list[int]:
        out = []
        for key in self.keys[s * self.n:(s + 1) * self.n]:
            pin = self.store.pin(key)
            if pin is None:
                out.append(-1)
                continue
            import xxhash

            out.append(xxhash.xxh3_64_intdigest(pin.view))
            pin.release()
        return out


class _TransportFetcher(_StoreFetcher):
    """The sidecar's own client: lookup and fetch over tcp (plain or TLS) or ucx."""

    def __init__(self, args: argparse.Namespace, size: int, n: int) -> None:
        super().__init__(args, size, n)
        self.address, raw_address = args.address.split("|")
        host, port = raw_address.rsplit(":", 1)
        self.raw = socket.create_connection((host, int(port)))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.session_key = bytes.fromhex(args.session_key)
        self.ssl = _tls_context(args, "client")
        self.method = args.method
        self.client: Any = None

    async def open(self) -> None:
        from kv_offload_sidecar.data import connect

        self.client = await connect(self.address, SESSION_ID, self.session_key, timeout=30, ssl=self.ssl,
                                    lanes=TCP_LANES.get(self.method, 1))

    async def fetch_set(self, s: int) -> None:
        keys = self.keys[s * self.n:(s + 1) * self.n]
        got = await self.client.fetch(keys, self.store, timeout=120)
        if got != len(keys):
            raise RuntimeError(f"fetched {got} of {len(keys)} chunks")

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        """32-key lookups, each followed by a raw 64-byte echo on a plain socket."""
        keys = self.keys[:LOOKUP_KEYS]
        lookups: list[float] = []
        raws: list[float] = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(lookups) < 20:
            t0 = time.perf_counter()
            await self.client.lookup(keys, timeout=10)
            lookups.append((time.perf_counter() - t0) * 1e6)
            raws.append(_echo_once(self.raw))
        return lookups, raws

    async def keep_alive(self) -> None:
        """A heartbeat on each of the client's connections, as a sidecar's links send them (a
        holder closes a connection silent for ``serving.SILENT_CLOSE_SECONDS``; the other
        methods' turns in a round can take that long)."""
        from kv_offload_sidecar.peers.liveness import RoundTrips, heartbeat

        await heartbeat(self.client, RoundTrips())

    async def loaded_round_trips(self, seconds: float) -> list[float]:
        """32-key lookups while this client's fetches stream (alternate sets, back to back): a
        lookup waits behind no chunk bytes when it has a connection of its own."""
        keys = self.keys[:LOOKUP_KEYS]
        stop = asyncio.Event()

        async def stream() -> None:
            s = 0
            while not stop.is_set():
                s ^= 1
                await self.fetch_set(s)

        streaming = asyncio.create_task(stream())
        lookups: list[float] = []
        try:
            await asyncio.sleep(0.05)  # the first fetch under way
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end or len(lookups) < 20:
                t0 = time.perf_counter()
                await self.client.lookup(keys, timeout=10)
                lookups.append((time.perf_counter() - t0) * 1e6)
                await asyncio.sleep(0.001)  # the fetch's turn on this loop
        finally:
            stop.set()
            await streaming
        return lookups

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        self.raw.close()
        self.store.close()


class _AiohttpFetcher(_StoreFetcher):
    """The naive baseline: one GET per chunk, body copied into a slot, checksum verified."""

    def __init__(self, args: argparse.Namespace, size: int, n: int) -> None:
        super().__init__(args, size, n)
        self.address = args.address
        self.session: Any = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession()

    async def fetch_set(self, s: int) -> None:
        for key in self.keys[s * self.n:(s + 1) * self.n]:
            async with self.session.get(f"{self.address}/chunk/{key.hex()}") as resp:
                resp.raise_for_status()
                body = await resp.read()
                checksum = int(resp.headers["X-Checksum"])
            res = self.store.begin_write(key)
            if res is None:
                raise RuntimeError("no free slot for the aiohttp baseline")
            res.view[:] = body
            if not res.commit(checksum):
                raise RuntimeError(f"chunk {key.hex()} failed its checksum")

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        return [], []

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.store.close()


if __name__ == "__main__":
    sys.exit(main())
