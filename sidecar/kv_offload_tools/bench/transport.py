"""`kv-offload bench transport`: the data plane against the machine's limits, in one run.

Every method moves the same chunks between two separate processes, pull model
(request -> last byte in the fetcher's own preallocated memory), side by side in
interleaved rounds so each ratio compares numbers taken moments apart:

- ``raw_tcp``: the limit: blocking ``sendall`` / ``recv_into`` a preallocated buffer.
- ``memcpy``: one core copying (``numpy.copyto``), in one process.
- ``tcp``: the sidecar's TCP transport, a peer fetch into store slots, checksums verified.
- ``ucx_sm`` / ``ucx_tcp``: the sidecar's UCX transport with ``UCX_TLS=sm,self`` / ``tcp,self``
  (one lane: the holder copies every chunk, the default).
- ``ucx_sm_2lanes``: the UCX transport over ``sm`` with two lanes (``--ucx-lanes 2``: every
  third chunk is copied by the fetcher, so both processes' cores copy).
- ``ucx_sm_limit``: bare ucxx between busy-polling processes, two lanes, every chunk
  hashed on arrival (``bench/ucx_limit.py``): what any ucxx data plane that verifies
  its chunks can reach here; the gap to ``ucx_sm_2lanes`` is the transport's overhead.
- ``ucx_sm_tagsend``: bare ucxx, one lane, nothing verified: plain UCX tag send/recv over
  CMA, the reference issue 7 set its UCX targets by (then 2.7x raw TCP).
- ``aiohttp_get``: the naive baseline, one HTTP GET per chunk, copied into a slot, verified.

Plus the round trip of a 32-key peer lookup on the transports' persistent
connection against a raw 64-byte TCP round trip. Prints a table (median GB/s,
min-max, ratio to raw TCP in the same round), the targets of issue 7, writes a
PNG plot; ``--json`` prints one JSON object instead of the table (with the UCX
settings each UCX client ran with). ``--ucx-env KEY=VALUE,...`` tries UCX knobs
(e.g. ``UCX_RNDV_SCHEME=get_zcopy``) in the UCX methods' processes only.

Each method runs as a server process and a client process started by this
command (``--role`` is internal); they talk JSON lines over stdin/stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Methods measured, in the order of the table.
METHODS = ("raw_tcp", "memcpy", "tcp", "ucx_sm", "ucx_sm_2lanes", "ucx_sm_limit", "ucx_sm_tagsend",
           "ucx_tcp", "aiohttp_get")
# Chunk sizes measured by default (bytes).
DEFAULT_CHUNK_BYTES = (262144, 2097152, 16777216)
# Keys per lookup request.
LOOKUP_KEYS = 32
# Session of the benchmark's data connections.
_SESSION_ID = b"bench"
# What each method needs in its process environment (UCX reads it once per process).
_UCX_TLS = {"ucx_sm": "sm,self", "ucx_sm_2lanes": "sm,self", "ucx_sm_limit": "sm,self",
            "ucx_sm_tagsend": "sm,self", "ucx_tcp": "tcp,self"}
# Bare-ucxx methods (bench/ucx_limit.py): method -> (lanes, chunks hashed on arrival).
_UCX_BARE = {"ucx_sm_limit": (2, True), "ucx_sm_tagsend": (1, False)}
# UCX lanes of each UCX method's client (see transport.ucx.configure_ucx_env).
_UCX_LANES = {"ucx_sm_2lanes": 2}
# Methods whose clients also time peer lookups.
_LOOKUP_METHODS = ("tcp", "ucx_sm", "ucx_tcp")
# Targets of issue 7: (description, method, chunk sizes, baseline, minimum ratio).
TARGETS = (
    ("TCP transport >= 0.8x raw TCP", "tcp", (2097152, 16777216), "raw_tcp", 0.8),
    ("UCX sm >= 2.0x raw TCP", "ucx_sm", (2097152, 16777216), "raw_tcp", 2.0),
    ("UCX sm, two lanes >= 2.0x raw TCP", "ucx_sm_2lanes", (2097152, 16777216), "raw_tcp", 2.0),
    ("UCX sm >= 3x one-GET-per-chunk aiohttp", "ucx_sm", (2097152,), "aiohttp_get", 3.0),
    ("TCP transport >= 1.5x one-GET-per-chunk aiohttp", "tcp", (2097152,), "aiohttp_get", 1.5),
)
# Target of the lookup: p50 at most this many raw 64-byte TCP round trips.
LOOKUP_TARGET_RATIO = 4.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kv-offload bench transport``."""
    parser.add_argument("--chunk-bytes", default=",".join(map(str, DEFAULT_CHUNK_BYTES)),
                        help="comma-separated chunk sizes in bytes (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="seconds each method moves data per round and size (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; medians are over rounds (default %(default)s)")
    parser.add_argument("--set-bytes", type=int, default=64 << 20,
                        help="bytes fetched per iteration (chunks = set-bytes / chunk size, "
                             "at least 2; default %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--plot", default="kv-offload-bench-transport.png",
                        help="PNG written with the results (default %(default)s; '' for none)")
    parser.add_argument("--shm-dir", default="/dev/shm",
                        help="directory of the benchmark's chunk stores (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    parser.add_argument("--ucx-env", default="",
                        help="extra UCX settings for the UCX methods' processes, comma-separated "
                             "KEY=VALUE (e.g. UCX_RNDV_THRESH=64k), applied over the transport's own")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--session-key", help=argparse.SUPPRESS)


def _usage(message: str) -> Exception:
    return ValueError(f"kv-offload bench transport: {message}")


def _parse(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    try:
        sizes = [int(x) for x in str(args.chunk_bytes).split(",") if x.strip()]
    except ValueError:
        raise _usage(f"--chunk-bytes {args.chunk_bytes!r} must be comma-separated integers") from None
    if not sizes or any(s < 4096 or s > 1 << 30 for s in sizes):
        raise _usage(f"--chunk-bytes {args.chunk_bytes!r}: each size must be 4096..1073741824")
    methods = [m.strip() for m in str(args.methods).split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise _usage(f"--methods {args.methods!r}: unknown {unknown}; choose from {','.join(METHODS)}")
    if "raw_tcp" not in methods:
        methods.insert(0, "raw_tcp")  # every ratio needs the limit measured in the same round
    _ucx_env(args.ucx_env)
    if args.seconds <= 0 or args.rounds < 1:
        raise _usage("--seconds must be > 0 and --rounds >= 1")
    if not os.path.isdir(args.shm_dir):
        raise _usage(f"--shm-dir {args.shm_dir!r} is not a directory")
    return sizes, [m for m in METHODS if m in methods]


def _ucx_env(text: str) -> dict[str, str]:
    """``--ucx-env`` as a dict; ValueError naming the item that is not ``UCX_...=value``."""
    out = {}
    for item in (x.strip() for x in str(text or "").split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.startswith(("UCX_", "UCXPY_")):
            raise _usage(f"--ucx-env item {item!r} must be UCX_NAME=value")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand (and of its worker processes)."""
    if args.role:
        return _worker_main(args)
    try:
        sizes, methods = _parse(args)
    except ValueError as exc:  # bad input: one line, exit 2, nothing on stdout
        print(str(exc), file=sys.stderr)
        return 2
    report = _orchestrate(args, sizes, methods)
    if args.plot:
        _plot(report, args.plot)
        report["plot"] = os.path.abspath(args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0


# ====================================================================== orchestration


@dataclass
class _Worker:
    """A worker process answering JSON lines."""

    # The process.
    proc: subprocess.Popen
    # What it is, for messages.
    name: str

    def ask(self, command: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def read(self, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            self.proc.kill()
            raise RuntimeError(f"bench worker {self.name} died or hung (exit {self.proc.poll()})")
        out = json.loads(result[0])
        if "error" in out:
            raise RuntimeError(f"bench worker {self.name}: {out['error']}")
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


def _spawn(role: str, method: str, chunk_bytes: int, chunks: int, args: argparse.Namespace,
           session_key: str, address: str = "") -> _Worker:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("UCX_", "UCXPY_")):
            del env[key]
    cmd = [sys.executable, "-m", "kv_offload_tools.bench.transport", "--role", role,
           "--method", method, "--chunk-bytes", str(chunk_bytes), "--set-bytes", str(chunks * chunk_bytes),
           "--shm-dir", args.shm_dir, "--session-key", session_key, "--address", address,
           f"--ucx-env={args.ucx_env}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return _Worker(proc, f"{role}:{method}:{chunk_bytes}")


def _progress(message: str) -> None:
    print(f"[bench transport] {message}", file=sys.stderr, flush=True)


def _orchestrate(args: argparse.Namespace, sizes: list[int], methods: list[str]) -> dict[str, Any]:
    session_key = secrets.token_hex(32)
    gbps: dict[tuple[str, int], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    identical: dict[tuple[str, int], bool] = {}
    lookup: dict[str, Any] = {}
    ucx_settings: dict[str, dict[str, str]] = {}  # UCX environment each UCX client ran with
    for size in sizes:
        chunks = max(2, args.set_bytes // size)
        _progress(f"starting peers for {_fmt_size(size)} chunks ({chunks} per fetch)")
        servers: dict[str, _Worker] = {}
        clients: dict[str, _Worker] = {}
        try:
            for m in methods:
                if m != "memcpy":
                    servers[m] = _spawn("server", m, size, chunks, args, session_key)
            addresses = {m: w.read()["address"] for m, w in servers.items()}
            for m in methods:
                address = addresses.get(m, "")
                if m == "tcp" or m in _UCX_TLS:  # lookups alternate with raw round trips
                    address += "|" + addresses["raw_tcp"]
                clients[m] = _spawn("client", m, size, chunks, args, session_key, address)
            for m, w in clients.items():
                ready = w.read()  # ready (connected, warmed up)
                if ready.get("ucx"):
                    ucx_settings[m] = ready["ucx"]
            for r in range(args.rounds):
                round_gbps: dict[str, float] = {}
                for m in methods:
                    out = clients[m].ask({"cmd": "fetch", "seconds": args.seconds})
                    round_gbps[m] = out["gbps"]
                    gbps.setdefault((m, size), []).append(out["gbps"])
                    identical[(m, size)] = identical.get((m, size), True) and out["identical"]
                    _progress(f"round {r + 1}/{args.rounds} {_fmt_size(size):>7} {m:<12} "
                              f"{out['gbps']:6.2f} GB/s{'' if out['identical'] else '  BYTES DIFFER'}")
                for m in methods:
                    ratios.setdefault((m, size), []).append(round_gbps[m] / round_gbps["raw_tcp"])
            if size == sizes[0]:
                lookup = _measure_lookups(args, clients, methods)
        finally:
            for w in [*clients.values(), *servers.values()]:
                w.stop()
    results = []
    for size in sizes:
        for m in methods:
            values = gbps[(m, size)]
            results.append({
                "method": m, "chunk_bytes": size,
                "gbps_median": statistics.median(values), "gbps_min": min(values),
                "gbps_max": max(values),
                "ratio_to_raw_tcp": statistics.median(ratios[(m, size)]),
                "rounds": len(values), "identical": identical[(m, size)],
            })
    report = {"results": results, "lookup": lookup, "ucx_settings": ucx_settings,
              "rounds": args.rounds,
              "seconds_per_measurement": args.seconds, "cpus": os.cpu_count()}
    report["targets"] = _targets(report)
    report["ceilings"] = _ceilings(report)
    return report


def _measure_lookups(args: argparse.Namespace, clients: dict[str, _Worker],
                     methods: list[str]) -> dict[str, Any]:
    """32-key lookups on each transport's connection, each alternating sample by sample
    with a raw 64-byte TCP round trip from the same process (same CPU conditions)."""
    transports = [m for m in _LOOKUP_METHODS if m in methods]
    lookups: dict[str, list[float]] = {m: [] for m in transports}
    raws: dict[str, list[float]] = {m: [] for m in transports}
    for r in range(max(args.rounds, 1)):
        for m in transports:
            out = clients[m].ask({"cmd": "rtt", "seconds": min(args.seconds, 1.0)})
            lookups[m].extend(out["us"])
            raws[m].extend(out["raw_us"])
        _progress(f"lookup round {r + 1}: " + ", ".join(
            f"{m} p50 {statistics.median(lookups[m]):.0f} us (raw {statistics.median(raws[m]):.0f} us)"
            for m in transports))
    if not transports:
        return {}
    # One raw reference for the run: every raw sample taken alongside any transport's
    # lookups (a process that just spun on its own reply sees a faster raw trip than
    # one that slept, so a per-process reference would favour the slow sleeper).
    pooled = _percentiles([us for m in transports for us in raws[m]])
    by = {}
    for m in transports:
        p = _percentiles(lookups[m])
        p.update(raw_rtt_p50_us_alongside=_percentiles(raws[m])["p50_us"],
                 ratio_to_raw_rtt=p["p50_us"] / pooled["p50_us"])
        by[m] = p
    main = "tcp" if "tcp" in by else transports[0]  # the transport every deployment has
    return {"keys": LOOKUP_KEYS, "transport": main, **by[main], "raw_rtt_p50_us": pooled["p50_us"],
            "raw_rtt_p99_us": pooled["p99_us"], "by_transport": by}


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"p50_us": values[len(values) // 2],
            "p99_us": values[min(len(values) - 1, int(len(values) * 0.99))], "samples": len(values)}


def _targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    out = []
    for text, method, sizes, base, need in TARGETS:
        for size in sizes:
            if (method, size) not in by or (base, size) not in by:
                continue
            ratio = by[(method, size)]["ratio_to_raw_tcp"] / by[(base, size)]["ratio_to_raw_tcp"]
            out.append({"target": f"{text} at {_fmt_size(size)}", "ratio": ratio, "required": need,
                        "met": ratio >= need})
    lk = report.get("lookup") or {}
    if "ratio_to_raw_rtt" in lk:
        out.append({"target": f"{LOOKUP_KEYS}-key lookup p50 <= {LOOKUP_TARGET_RATIO:g}x raw 64-byte "
                              f"TCP round trip ({lk['transport']})",
                    "ratio": lk["ratio_to_raw_rtt"], "required": LOOKUP_TARGET_RATIO,
                    "met": lk["ratio_to_raw_rtt"] <= LOOKUP_TARGET_RATIO})
    return out


# Rows that bound what any data plane can reach here, printed beside the targets.
CEILING_METHODS = ("memcpy", "ucx_sm_limit", "ucx_sm_tagsend")


def _ceilings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per chunk size, the ratios to raw TCP of the rows that bound the UCX targets: one
    core's memcpy, bare ucxx with both cores copying and verifying, bare tag send/recv."""
    out = []
    for size in sorted({r["chunk_bytes"] for r in report["results"]}):
        ratios = {r["method"]: r["ratio_to_raw_tcp"] for r in report["results"]
                  if r["chunk_bytes"] == size and r["method"] in CEILING_METHODS}
        if ratios:
            out.append({"chunk_bytes": size, "ratios": ratios})
    return out


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'chunk':>8}  {'method':<12} {'GB/s median':>11}  {'min-max':>13}  {'x raw TCP':>9}  bytes"]
    for r in report["results"]:
        lines.append(f"{_fmt_size(r['chunk_bytes']):>8}  {r['method']:<12} {r['gbps_median']:>11.2f}  "
                     f"{r['gbps_min']:>6.2f}-{r['gbps_max']:<6.2f}  {r['ratio_to_raw_tcp']:>8.2f}x  "
                     f"{'identical' if r['identical'] else 'DIFFER'}")
    lk = report.get("lookup") or {}
    if lk:
        lines.append("")
        lines.append(f"raw 64-byte TCP round trip (alternating with the lookups): p50 "
                     f"{lk['raw_rtt_p50_us']:.0f} us, p99 {lk['raw_rtt_p99_us']:.0f} us")
        for m, p in lk.get("by_transport", {}).items():
            lines.append(f"{LOOKUP_KEYS}-key lookup over {m:<8}: p50 {p['p50_us']:6.0f} us, "
                         f"p99 {p['p99_us']:6.0f} us = {p['ratio_to_raw_rtt']:.2f}x raw "
                         f"(raw in that process: {p['raw_rtt_p50_us_alongside']:.0f} us)")
    if report.get("targets"):
        lines.append("")
        for t in report["targets"]:
            lines.append(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['ratio']:.2f}x "
                         f"(required {t['required']:g}x)")
    for c in report.get("ceilings", []):
        parts = ", ".join(f"{m} {c['ratios'][m]:.2f}x" for m in CEILING_METHODS if m in c["ratios"])
        lines.append(f"[ceiling] at {_fmt_size(c['chunk_bytes'])} the machine allows: {parts} raw TCP")
    if report.get("plot"):
        lines.append(f"\nplot: {report['plot']}")
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["chunk_bytes"] for r in report["results"]})
    methods = [m for m in METHODS if any(r["method"] == m for r in report["results"])]
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, s in enumerate(sizes):
            r = by[(m, s)]
            xs.append(i + j * width)
            ys.append(r["gbps_median"])
            lo.append(r["gbps_median"] - r["gbps_min"])
            hi.append(r["gbps_max"] - r["gbps_median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [_fmt_size(s) for s in sizes])
    ax.set_xlabel("chunk size")
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_title(f"kv-offload data plane, {report['rounds']} interleaved rounds, "
                 f"{report['cpus']} CPUs")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # clear of the bars
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ====================================================================== workers


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
    if method in _UCX_TLS:
        from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env

        tls = _UCX_TLS[method]
        configure_ucx_env(tls, net_devices="lo" if tls.startswith("tcp") else None,
                          lanes=_UCX_LANES.get(method, 1))
        os.environ.update(_ucx_env(args.ucx_env))
    size = int(args.chunk_bytes)
    chunks = int(args.set_bytes) // size  # the orchestrator passes a whole number of chunks
    try:
        if args.role == "server":
            if method == "raw_tcp":
                _raw_server(size, chunks)
            elif method == "aiohttp_get":
                asyncio.run(_aiohttp_server(args, size, chunks))
            elif method in _UCX_BARE:
                _ucx_limit_server(args, size, chunks)
            else:
                asyncio.run(_transport_server(args, size, chunks))
        else:
            asyncio.run(_client(args, size, chunks))
    except BrokenPipeError:
        pass
    return 0


def _commands() -> Any:
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        yield cmd


async def _acommands() -> Any:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        yield cmd


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
        with conn:
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


def _ucx_limit_server(args: argparse.Namespace, size: int, n: int) -> None:
    from kv_offload_tools.bench.ucx_limit import run_server

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
    kind = "ucx" if args.method in _UCX_TLS else "tcp"
    server = make_server(kind, store, {_SESSION_ID: key}.get, None, chunk_bytes=size)
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
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
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
               if method in _UCX_TLS else {})
        _emit({"ready": True, "ucx": ucx})
        async for cmd in _acommands():
            if cmd["cmd"] == "fetch":
                moved, t0 = 0, time.perf_counter()
                while True:  # alternate sets: the store holds one, so every chunk is absent
                    s ^= 1
                    await fetcher.fetch_set(s)
                    moved += n * size
                    if time.perf_counter() - t0 >= cmd["seconds"]:
                        break
                elapsed = time.perf_counter() - t0
                ok = fetcher.digests(s) == expected[s * n:(s + 1) * n]
                _emit({"gbps": moved / elapsed / 1e9, "identical": ok})
            elif cmd["cmd"] == "rtt":
                lookup_us, raw_us = await fetcher.round_trips(cmd["seconds"])
                _emit({"us": lookup_us, "raw_us": raw_us})
    except Exception as exc:
        _emit({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        await fetcher.close()


async def _make_fetcher(method: str, args: argparse.Namespace, size: int, n: int,
                        expected: list[int]) -> Any:
    if method == "raw_tcp":
        return _RawFetcher(args.address, size, n)
    if method in _UCX_BARE:
        from kv_offload_tools.bench.ucx_limit import UcxLimitFetcher

        lanes, verify = _UCX_BARE[method]
        return UcxLimitFetcher(args, size, n, expected, lanes=lanes, verify=verify)
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
    """The limit: blocking ``recv_into`` a preallocated pool, no checksum, no bookkeeping."""

    def __init__(self, address: str, size: int, n: int) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size, self.n = size, n
        self.pool = bytearray(size * n)
        self.views = [memoryview(self.pool)[i * size:(i + 1) * size] for i in range(n)]

    def _fetch(self, s: int) -> None:
        self.sock.sendall(struct.pack("!QQ", self.n, s * self.n).ljust(64, b"\0"))
        for v in self.views:
            got = 0
            while got < self.size:
                k = self.sock.recv_into(v[got:], self.size - got)
                if not k:
                    raise ConnectionError("raw server closed")
                got += k

    async def fetch_set(self, s: int) -> None:
        self._fetch(s)

    def digests(self, s: int) -> list[int]:
        import xxhash

        return [xxhash.xxh3_64_intdigest(v) for v in self.views]

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        return [], []

    async def close(self) -> None:
        self.sock.close()


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
    """The sidecar's own client: lookup and fetch over tcp or ucx."""

    def __init__(self, args: argparse.Namespace, size: int, n: int) -> None:
        super().__init__(args, size, n)
        self.address, raw_address = args.address.split("|")
        host, port = raw_address.rsplit(":", 1)
        self.raw = socket.create_connection((host, int(port)))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.session_key = bytes.fromhex(args.session_key)
        self.client: Any = None

    async def open(self) -> None:
        from kv_offload_sidecar.data import connect

        self.client = await connect(self.address, _SESSION_ID, self.session_key, timeout=30)

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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kv_offload_tools.bench.transport`` (worker processes)."""
    parser = argparse.ArgumentParser(prog="kv-offload bench transport")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
