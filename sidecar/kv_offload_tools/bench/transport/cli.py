"""`kv-offload bench transport`: the data plane against the machine's limits, in one run.

Every method (``transport/methods.py``: raw TCP, memcpy, the sidecar's TCP
transport plain and under TLS, its UCX transport, bare ucxx, one aiohttp GET per
chunk) moves the same chunks between two separate processes, pull model (request
-> last byte in the fetcher's own preallocated memory), side by side in
interleaved rounds so each ratio compares numbers taken moments apart. Holders (servers)
run on the first half of the CPUs and fetchers (clients) on the rest, as two pods' sidecars
would; each side's CPU-seconds per GB is reported apart (raw TCP's: its sender's and its
receiver's), and the TCP transport with 2, 4 and 8 lanes (and 2 under TLS) beside raw TCP with as
many streams, with the fetcher's CPU-seconds per GB at 1, 2, 4 and 8 lanes against raw TCP's
receiver with as many streams (``lanes_cpu``). Plus the
round trip of a 32-key peer lookup on the transports' persistent connection
against a raw 64-byte TCP round trip taken alternately from the same process, and (the TCP
transport) the same lookup while that client's fetches stream. Prints a table (median GB/s, min-max, ratio
to raw TCP in the same round, CPU-seconds per GB of both processes), the targets,
the ceilings and what TLS costs against plain TCP (``transport/report.py``),
writes a PNG plot; ``--json`` prints one JSON object instead of the table
(with the UCX settings each UCX client ran with). ``--ucx-env KEY=VALUE,...``
tries UCX knobs (e.g. ``UCX_RNDV_SCHEME=get_zcopy``) in the UCX methods'
processes only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.bench.transport.methods import (
    LANES_TWIN,
    LOOKUP_KEYS,
    LOOKUP_METHODS,
    METHODS,
    PLAIN_TWIN,
    RAW_ALONGSIDE,
    TLS_METHODS,
    parse_ucx_env,
    worker_argv,
)
from kv_offload_tools.bench.transport.report import (
    ceilings,
    fmt_size,
    lanes_cpu,
    lanes_scaling,
    percentiles,
    plot,
    table,
    targets,
    tls_overhead,
    verification_cost,
)

# Methods whose processes are also measured idle (connected, nothing moving).
IDLE_METHODS = ("nixl",)
# Seconds of that idle measurement.
IDLE_SECONDS = 3.0
# Chunk sizes measured by default (bytes).
DEFAULT_CHUNK_BYTES = (262144, 2097152, 16777216)


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


def _usage(message: str) -> UsageError:
    return UsageError(f"kv-offload bench transport: {message}")


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
    methods += [PLAIN_TWIN[m] for m in methods if m in PLAIN_TWIN and PLAIN_TWIN[m] not in methods]
    try:
        parse_ucx_env(args.ucx_env)
    except ValueError as exc:
        raise _usage(str(exc)) from None
    if args.seconds <= 0 or args.rounds < 1:
        raise _usage("--seconds must be > 0 and --rounds >= 1")
    if not os.path.isdir(args.shm_dir):
        raise _usage(f"--shm-dir {args.shm_dir!r} is not a directory")
    return sizes, [m for m in METHODS if m in methods]


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand."""
    sizes, methods = _parse(args)
    report = _orchestrate(args, sizes, methods)
    if args.plot:
        plot(report, args.plot)
        report["plot"] = os.path.abspath(args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
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


def pinning() -> dict[str, list[int]]:
    """The CPUs of each side: the holder (server) the first half of this process's CPUs, the
    fetcher (client) the rest, as two pods' sidecars would each have their own; both all
    of them on a one-CPU host."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    if half == 0:
        return {"holder": cpus, "fetcher": cpus}
    return {"holder": cpus[:half], "fetcher": cpus[half:]}


def _spawn(role: str, method: str, chunk_bytes: int, chunks: int, args: argparse.Namespace,
           session_key: str, address: str = "", tls_dir: str = "") -> _Worker:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("UCX_", "UCXPY_")):
            del env[key]
    cmd = worker_argv(role, method, chunk_bytes, chunks * chunk_bytes, args.shm_dir, session_key, address,
                      args.ucx_env, tls_dir)
    cpus = set(pinning()["holder" if role == "server" else "fetcher"])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    return _Worker(proc, f"{role}:{method}:{chunk_bytes}")


def _progress(message: str) -> None:
    print(f"[bench transport] {message}", file=sys.stderr, flush=True)


def _orchestrate(args: argparse.Namespace, sizes: list[int], methods: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-tls-") as tls_dir:
        if any(m in TLS_METHODS for m in methods):
            from kv_offload_testing.certs import pool_certificates

            pool_certificates(tls_dir, ["server", "client"])  # a throw-away pool CA for tcp+tls
        return _run_rounds(args, sizes, methods, tls_dir)


def _run_rounds(args: argparse.Namespace, sizes: list[int], methods: list[str],
                tls_dir: str) -> dict[str, Any]:
    session_key = secrets.token_hex(32)
    gbps: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}  # CPU-seconds per GB, both processes
    side_cpu: dict[tuple[str, int, str], list[float]] = {}  # ... of the holder, of the fetcher
    lanes_ratios: dict[tuple[str, int], list[float]] = {}  # GB/s vs raw TCP with as many streams
    ratios: dict[tuple[str, int], list[float]] = {}
    twin_ratios: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (GB/s, CPU s/GB) vs the twin
    identical: dict[tuple[str, int], bool] = {}
    lookup: dict[str, Any] = {}
    idle: dict[str, Any] = {}
    ucx_settings: dict[str, dict[str, str]] = {}  # UCX environment each UCX client ran with
    for size in sizes:
        chunks = max(2, args.set_bytes // size)
        _progress(f"starting peers for {fmt_size(size)} chunks ({chunks} per fetch)")
        servers: dict[str, _Worker] = {}
        clients: dict[str, _Worker] = {}
        try:
            for m in methods:
                if m != "memcpy":
                    servers[m] = _spawn("server", m, size, chunks, args, session_key, tls_dir=tls_dir)
            addresses = {m: w.read()["address"] for m, w in servers.items()}
            for m in methods:
                address = addresses.get(m, "")
                if m in RAW_ALONGSIDE:  # lookups alternate with raw round trips
                    address += "|" + addresses["raw_tcp"]
                clients[m] = _spawn("client", m, size, chunks, args, session_key, address, tls_dir)
            for m, w in clients.items():
                ready = w.read()  # ready (connected, warmed up)
                if ready.get("ucx"):
                    ucx_settings[m] = ready["ucx"]
            for r in range(args.rounds):
                round_gbps: dict[str, float] = {}
                round_cpu: dict[str, float] = {}
                for m in methods:
                    server = servers.get(m)
                    before = server.ask({"cmd": "cpu"})["cpu_seconds"] if server else 0.0
                    out = clients[m].ask({"cmd": "fetch", "seconds": args.seconds})
                    after = server.ask({"cmd": "cpu"})["cpu_seconds"] if server else 0.0
                    round_gbps[m] = out["gbps"]
                    gb = out["bytes"] / 1e9
                    round_cpu[m] = (out["cpu_seconds"] + after - before) / gb
                    side_cpu.setdefault((m, size, "holder"), []).append((after - before) / gb)
                    side_cpu.setdefault((m, size, "fetcher"), []).append(out["cpu_seconds"] / gb)
                    gbps.setdefault((m, size), []).append(out["gbps"])
                    cpu.setdefault((m, size), []).append(round_cpu[m])
                    identical[(m, size)] = identical.get((m, size), True) and out["identical"]
                    _progress(f"round {r + 1}/{args.rounds} {fmt_size(size):>7} {m:<15} "
                              f"{out['gbps']:6.2f} GB/s {round_cpu[m]:5.2f} CPU s/GB"
                              f"{'' if out['identical'] else '  BYTES DIFFER'}")
                for m in methods:
                    ratios.setdefault((m, size), []).append(round_gbps[m] / round_gbps["raw_tcp"])
                    if m in LANES_TWIN and LANES_TWIN[m] in round_gbps:
                        lanes_ratios.setdefault((m, size), []).append(round_gbps[m] / round_gbps[LANES_TWIN[m]])
                    if m in PLAIN_TWIN:
                        twin = PLAIN_TWIN[m]
                        twin_ratios.setdefault((m, size), []).append(
                            (round_gbps[m] / round_gbps[twin], round_cpu[m] / round_cpu[twin]))
            if size == sizes[0]:
                lookup = _measure_lookups(args, clients, methods)
                idle = _measure_idle(servers, clients, [m for m in IDLE_METHODS if m in methods])
        finally:
            for w in [*clients.values(), *servers.values()]:
                w.stop()
    results = []
    for size in sizes:
        for m in methods:
            values = gbps[(m, size)]
            row = {
                "method": m, "chunk_bytes": size,
                "gbps_median": statistics.median(values), "gbps_min": min(values),
                "gbps_max": max(values),
                "ratio_to_raw_tcp": statistics.median(ratios[(m, size)]),
                "cpu_seconds_per_gb": statistics.median(cpu[(m, size)]),
                "holder_cpu_seconds_per_gb": statistics.median(side_cpu[(m, size, "holder")]),
                "fetcher_cpu_seconds_per_gb": statistics.median(side_cpu[(m, size, "fetcher")]),
                "rounds": len(values), "identical": identical[(m, size)],
            }
            if (m, size) in lanes_ratios:
                row.update(streams_twin=LANES_TWIN[m],
                           ratio_to_streams_twin=statistics.median(lanes_ratios[(m, size)]))
            if m in PLAIN_TWIN:
                pairs = twin_ratios[(m, size)]
                row.update(compared_to=PLAIN_TWIN[m],
                           ratio_to_twin=statistics.median(p[0] for p in pairs),
                           cpu_ratio_to_twin=statistics.median(p[1] for p in pairs))
            results.append(row)
    report = {"results": results, "lookup": lookup, "ucx_settings": ucx_settings, "idle": idle,
              "rounds": args.rounds,
              "seconds_per_measurement": args.seconds, "cpus": os.cpu_count(), "pinning": pinning()}
    report["targets"] = targets(report)
    report["ceilings"] = ceilings(report)
    report["tls"] = tls_overhead(report)
    report["verification"] = verification_cost(report)
    report["lanes"] = lanes_scaling(report)
    report["lanes_cpu"] = lanes_cpu(report)
    return report


def _measure_idle(servers: dict[str, _Worker], clients: dict[str, _Worker], methods: list[str]) -> dict[str, Any]:
    """Share of a core each process of ``methods`` uses over ``IDLE_SECONDS`` while its peer is
    connected and nothing moves (the holder's progress calls, the lanes' waits)."""
    import time

    out: dict[str, Any] = {}
    for m in methods:
        workers = {"holder": servers[m], "fetcher": clients[m]}
        before = {role: w.ask({"cmd": "cpu"})["cpu_seconds"] for role, w in workers.items()}
        t0 = time.monotonic()
        time.sleep(IDLE_SECONDS)
        elapsed = time.monotonic() - t0
        shares = {role: (w.ask({"cmd": "cpu"})["cpu_seconds"] - before[role]) / elapsed
                  for role, w in workers.items()}
        out[m] = {"seconds": elapsed, "holder_core_share": shares["holder"],
                  "fetcher_core_share": shares["fetcher"]}
        _progress(f"idle {m}: holder {100 * shares['holder']:.2f}% of a core, "
                  f"fetcher {100 * shares['fetcher']:.2f}% over {elapsed:.1f} s")
    return out


def _measure_lookups(args: argparse.Namespace, clients: dict[str, _Worker],
                     methods: list[str]) -> dict[str, Any]:
    """32-key lookups on each transport's connection, each alternating sample by sample
    with a raw 64-byte TCP round trip from the same process (same CPU conditions)."""
    transports = [m for m in LOOKUP_METHODS if m in methods]
    lookups: dict[str, list[float]] = {m: [] for m in transports}
    raws: dict[str, list[float]] = {m: [] for m in transports}
    loaded: dict[str, list[float]] = {m: [] for m in transports}
    for r in range(max(args.rounds, 1)):
        for m in transports:
            out = clients[m].ask({"cmd": "rtt", "seconds": min(args.seconds, 1.0)})
            lookups[m].extend(out["us"])
            raws[m].extend(out["raw_us"])
            loaded[m].extend(out.get("loaded_us", []))
        _progress(f"lookup round {r + 1}: " + ", ".join(
            f"{m} p50 {statistics.median(lookups[m]):.0f} us (raw {statistics.median(raws[m]):.0f} us)"
            for m in transports))
    if not transports:
        return {}
    # One raw reference for the run: every raw sample taken alongside any transport's
    # lookups (a process that just spun on its own reply sees a faster raw trip than
    # one that slept, so a per-process reference would favour the slow sleeper).
    pooled = percentiles([us for m in transports for us in raws[m]])
    by = {}
    for m in transports:
        p = percentiles(lookups[m])
        p.update(raw_rtt_p50_us_alongside=percentiles(raws[m])["p50_us"],
                 ratio_to_raw_rtt=p["p50_us"] / pooled["p50_us"])
        if loaded[m]:  # while the same client's fetches stream
            p["while_fetching"] = percentiles(loaded[m])
        by[m] = p
    main = "tcp" if "tcp" in by else transports[0]  # the transport every deployment has
    return {"keys": LOOKUP_KEYS, "transport": main, **by[main], "raw_rtt_p50_us": pooled["p50_us"],
            "raw_rtt_p99_us": pooled["p99_us"], "by_transport": by}
