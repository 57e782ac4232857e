"""`kv-offload bench mesh`: what many real sidecars on one host cost, per sidecar, as the pool grows.

For each pod count (``--pods``, default 8,16,32) it starts that many real ``kv-offload
sidecar`` processes on 127.0.0.1 at once (a mass join: ``LocalPool``, each the others'
static peer, a stand-in engine identity, ``--capacity-mib`` stores) and reads, per sidecar
(``measure``):

1. ``joined``: once the mesh settled (every sidecar's directory counts every member and
   none has a peer still connecting; deadline ``--join-timeout``) and ``--settle-seconds``
   more: open descriptors (``/proc/PID/fd``, sockets among them), threads and VmRSS /
   RssAnon (``/proc/PID/status``), peers with a connected session and with open data
   lanes; the seconds until every stand-in engine stated its identity (through the local
   socket), all were ready and the mesh settled, and what the join cost: handshakes
   (``kv_offload_handshakes_total`` summed; each end counts its own), connections and
   handshakes refused at the door (every peer comes from 127.0.0.1 here) and dial failures;
2. ``workload``: right after ``--writers`` pods stored ``--chunks`` chunks each and
   ``--readers`` other pods loaded all of them through the pool (every byte checked);
3. ``after_idle``: ``--idle-seconds`` later, nothing asked.

Then it fits descriptors per sidecar against pods (``report``: descriptors per extra
pod, phase by phase, and per peer with open data lanes) and judges issue 48's target
"descriptors per sidecar O(links), not O(pool)": met when idle sidecars grow by at most
``--max-descriptors-per-pod`` per extra pod. Figures, not pass/fail: it exits 0 once
measured, 1 when a chunk came back wrong or the workload fell short. Prints a table (or one
JSON object with ``--json``; progress always on stderr) and writes a PNG (``--plot``).
Memory: about 75 MiB of RSS per sidecar today, so 32 sidecars want ~2.5 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.progress import timestamped

# Most sidecars one pod count may start on this host.
MAX_PODS = 64


@dataclass(frozen=True)
class MeshSettings:
    # Pod counts, each a fresh pool started at once, e.g. (8, 16, 32).
    pods: tuple[int, ...] = (8, 16, 32)
    # Pods that store chunks in the workload (the first ones).
    writers: int = 2
    # Pods that load every writer's chunks (the next ones).
    readers: int = 4
    # Chunks each writer stores (16 KiB each with LocalPool's config).
    chunks: int = 32
    # Store size of each sidecar, MiB.
    capacity_mib: float = 4.0
    # Seconds the pool idles after it settled before the first reading.
    settle_seconds: float = 5.0
    # Seconds the pool idles after the workload before the last reading.
    idle_seconds: float = 30.0
    # Deadline of the mass join (start to settled), seconds.
    join_timeout: float = 300.0
    # The target: idle descriptors per sidecar grow by at most this many per extra pod.
    max_descriptors_per_pod: float = 1.0


def measure(n: int, s: MeshSettings, log: Any) -> dict[str, Any]:
    """Every figure of one pod count: a fresh pool, started at once, read three times."""
    from kv_offload_tools.bench.mesh.measure import (
        MassJoin,
        handshakes,
        share,
        snapshot,
        summary,
    )

    def phase(name: str, pool: MassJoin) -> dict[str, Any]:
        rows = snapshot(pool)
        m = summary(rows)
        log(f"[mesh x{n}] {name}: {m['fds']['mean']:.1f} fds, {m['threads']['mean']:.1f} threads, "
            f"{m['rss_bytes']['mean'] / 2**20:.1f} MiB RSS, {m['data_linked_peers']['mean']:.1f} peers data-linked "
            f"per sidecar")
        return {"summary": m, "sidecars": rows}

    log(f"[mesh x{n}] starting {n} sidecars at once")
    pool = MassJoin(n, capacity_bytes=int(s.capacity_mib * 2**20), publish_interval_seconds=1.0)
    pool.start(s.join_timeout)  # launches all, waits until ready, then settled
    try:
        join = {"identities_stated_seconds": pool.stated_at - pool.started_at,
                "ready_seconds": pool.ready_at - pool.started_at, "settled_seconds": pool.settled_at - pool.started_at,
                "handshakes": handshakes(pool)}
        log(f"[mesh x{n}] settled after {join['settled_seconds']:.1f} s "
            f"({join['handshakes']['accepted']:.0f} handshakes counted)")
        time.sleep(s.settle_seconds)  # the idle period measured, not a wait for a state
        join["handshakes_after_settle_seconds"] = handshakes(pool)
        phases = {"joined": phase("joined", pool)}
        lanes = pool[0].status()["data_lanes_offered"]
        writers = range(min(s.writers, n - 1))
        readers = range(len(writers), min(len(writers) + s.readers, n))
        work = share(pool, writers, readers, s.chunks, tag=f"mesh-{n}-{os.getpid()}-{time.monotonic_ns()}")
        log(f"[mesh x{n}] workload: loaded {work['loaded']}/{work['expected_loaded']} chunks, {work['wrong']} wrong")
        phases["workload"] = phase("workload", pool)
        time.sleep(s.idle_seconds)  # the idle period measured
        phases["after_idle"] = phase("after_idle", pool)
        join["handshakes_at_end"] = handshakes(pool)
    finally:
        pool.stop()
    return {"pods": n, "lanes_offered": lanes, "join": join, "workload": work, "phases": phases}


def run_mesh(s: MeshSettings, log: Any) -> dict[str, Any]:
    from kv_offload_tools.bench.mesh.report import descriptor_order

    rows = [measure(n, s, log) for n in s.pods]
    return {"settings": asdict(s), "host_cpus": os.cpu_count(), "results": rows,
            "descriptors": descriptor_order(rows, s.max_descriptors_per_pod),
            "notes": ["descriptors and sockets from /proc/PID/fd, threads and RSS from /proc/PID/status, read "
                      "before the bench's own requests to the sidecar",
                      "handshakes: kv_offload_handshakes_total summed over the pool; each end counts one it "
                      "made or answered, so a full mesh of N costs at least 2 x N x (N - 1)"]}


def _pods(text: str) -> tuple[int, ...]:
    try:
        pods = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"kv-offload bench mesh: --pods {text!r} must be comma-separated integers, "
                         "e.g. 8,16,32") from None
    if not pods or any(not 2 <= p <= MAX_PODS for p in pods):
        raise UsageError(f"kv-offload bench mesh: --pods {text!r} needs pod counts from 2 to {MAX_PODS}")
    return pods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MeshSettings()
    parser.add_argument("--pods", default="8,16,32", help="pod counts, each a pool started at once (default 8,16,32)")
    parser.add_argument("--writers", type=int, default=d.writers, help=f"pods that store (default {d.writers})")
    parser.add_argument("--readers", type=int, default=d.readers, help=f"pods that read (default {d.readers})")
    parser.add_argument("--chunks", type=int, default=d.chunks, help=f"chunks per writer (default {d.chunks})")
    parser.add_argument("--capacity-mib", type=float, default=d.capacity_mib,
                        help=f"store of each sidecar, MiB (default {d.capacity_mib:g})")
    parser.add_argument("--settle-seconds", type=float, default=d.settle_seconds,
                        help=f"idle seconds after the join settled, before the first reading "
                             f"(default {d.settle_seconds:g})")
    parser.add_argument("--idle-seconds", type=float, default=d.idle_seconds,
                        help=f"idle seconds after the workload, before the last reading (default {d.idle_seconds:g})")
    parser.add_argument("--join-timeout", type=float, default=d.join_timeout,
                        help=f"deadline of the mass join, seconds (default {d.join_timeout:g})")
    parser.add_argument("--max-descriptors-per-pod", type=float, default=d.max_descriptors_per_pod,
                        help="the target: idle descriptors per sidecar grow by at most this many per extra pod "
                             f"(default {d.max_descriptors_per_pod:g})")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--plot", default="mesh.png", help="PNG of the figures against pods ('' for none)")


def run(args: argparse.Namespace) -> int:
    for name in ("writers", "readers", "chunks"):
        if getattr(args, name) < 1:
            raise UsageError(f"kv-offload bench mesh: --{name} {getattr(args, name)} must be at least 1")
    for name in ("capacity_mib", "join_timeout"):
        if not getattr(args, name) > 0:
            raise UsageError(f"kv-offload bench mesh: --{name.replace('_', '-')} {getattr(args, name):g} "
                             f"must be positive")
    for name in ("settle_seconds", "idle_seconds", "max_descriptors_per_pod"):
        if not getattr(args, name) >= 0:
            raise UsageError(f"kv-offload bench mesh: --{name.replace('_', '-')} {getattr(args, name):g} "
                             "must be 0 or more")
    settings = MeshSettings(pods=_pods(args.pods), writers=args.writers, readers=args.readers, chunks=args.chunks,
                            capacity_mib=args.capacity_mib, settle_seconds=args.settle_seconds,
                            idle_seconds=args.idle_seconds, join_timeout=args.join_timeout,
                            max_descriptors_per_pod=args.max_descriptors_per_pod)
    report = run_mesh(settings, timestamped("bench mesh"))
    if args.plot:
        from kv_offload_tools.bench.mesh.report import write_plot
        report["plot"] = write_plot(args.plot, report)
    if args.json:
        print(json.dumps(report))
    else:
        from kv_offload_tools.bench.mesh.report import format_table
        print(format_table(report))
    failed = any(r["workload"]["wrong"] or r["workload"]["loaded"] < r["workload"]["expected_loaded"]
                 for r in report["results"])
    return 1 if failed else 0
