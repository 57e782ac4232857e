"""`kv-offload bench restarts`: a sidecar SIGKILLed again and again on a /dev/shm that holds one store.

One sidecar on a size-bounded tmpfs (``--capacity-mib`` of store plus ``--head-room-mib``,
far less than a second store; root only) and an engine client mapping its store, as
vLLM's tier does. Each of ``--rounds`` rounds SIGKILLs the sidecar, starts it again at
once and drives the client like an engine until its chunks are hits again
(``kv_offload_tools.shm_restarts``). Prints one row per round (when the new sidecar
served, when the engine hit again, its misses on the way) and the totals against the
target: every restart back to serving, no exception reaching the engine, no corrupt
chunk, hits again within ``--hit-within-seconds``. Exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from dataclasses import asdict
from typing import Any

from kv_offload_tools.bench import require_host
from kv_offload_tools.bench.number_flags import NumberFlag, add_number_flags, check_number_flags
from kv_offload_tools.progress import rows_to

# (flag, default, lowest, help)
_NUMBERS: tuple[NumberFlag, ...] = (
    ("--rounds", 20, 1, "SIGKILLs of the sidecar"),
    ("--capacity-mib", 64, 1, "the sidecar's store (--capacity-bytes) in MiB"),
    ("--head-room-mib", 2, 1, "the tmpfs beyond the store in MiB (config, sockets, log)"),
    ("--hit-within-seconds", 10.0, 0.1, "the target: seconds from a kill until the engine hits again"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_number_flags(parser, _NUMBERS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")


def _check(args: argparse.Namespace) -> None:
    check_number_flags(args, _NUMBERS)
    from kv_offload_tools.shm_restarts import tmpfs_unavailable
    require_host("restarts", tmpfs_unavailable())


def run(args: argparse.Namespace) -> int:
    _check(args)
    from kv_offload_testing.local_pool import LocalPool
    from kv_offload_tools.shm_restarts import bounded_tmpfs, kill_and_recover

    log = rows_to(args.json)
    # The client's one line per miss while the sidecar is away: the rows count them.
    logging.getLogger("kv_offload_sidecar.engine.client").setLevel(logging.ERROR)
    capacity, head_room = args.capacity_mib << 20, args.head_room_mib << 20
    rounds: list[dict[str, Any]] = []
    with bounded_tmpfs(capacity + head_room) as shm, \
            LocalPool(1, capacity_bytes=capacity, workdir=shm) as pool:
        client = pool.client(0)
        try:
            for n in range(args.rounds):
                r = asdict(kill_and_recover(pool, client, n))
                rounds.append(r)
                log(_row(n, r))
        finally:
            client.close()
        figures = {"capacity_bytes": capacity, "shm_bytes": capacity + head_room,
                   "hit_within_seconds": args.hit_within_seconds, "rounds": rounds,
                   "reattaches": client.reattaches}
    figures["summary"] = summary = _summary(figures)
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
    else:
        print(report(summary))
    return 0 if summary["met"] else 1


def _row(n: int, r: dict[str, Any]) -> str:
    def s(v: float | None) -> str:
        return "never" if v is None else f"{v:.2f} s"
    return (f"round {n + 1:>3}: serving after {s(r['served_seconds'])}, hits again after "
            f"{s(r['hit_seconds'])}, {r['misses']} misses, {len(r['raised'])} engine errors, "
            f"{r['corrupt']} corrupt, /dev/shm used {r['shm_used_bytes'] / (1 << 20):.1f} MiB")


def _summary(f: dict[str, Any]) -> dict[str, Any]:
    rounds = f["rounds"]
    hits = [r["hit_seconds"] for r in rounds if r["hit_seconds"] is not None]
    served = sum(r["served_seconds"] is not None for r in rounds)
    errors = sum(len(r["raised"]) for r in rounds)
    corrupt = sum(r["corrupt"] for r in rounds)
    within = sum(h <= f["hit_within_seconds"] for h in hits)
    return {"rounds": len(rounds), "served": served, "hit_again": len(hits), "within": within,
            "engine_errors": errors, "corrupt": corrupt,
            "hit_seconds_median": statistics.median(hits) if hits else None,
            "hit_seconds_max": max(hits) if hits else None,
            "capacity_bytes": f["capacity_bytes"], "shm_bytes": f["shm_bytes"],
            "hit_within_seconds": f["hit_within_seconds"],
            "met": served == within == len(rounds) and errors == corrupt == 0}


def report(s: dict[str, Any]) -> str:
    """The totals beside the target."""
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"
    n = s["rounds"]
    return "\n".join([
        f"sidecar SIGKILLed {n} times, store {s['capacity_bytes'] >> 20} MiB on a "
        f"{s['shm_bytes'] >> 20} MiB /dev/shm",
        f"{'':<28}{'measured':>12}{'target':>12}",
        f"{'restarts back to serving':<28}{s['served']:>9}/{n:<2}{n:>9}/{n:<2}",
        f"{'engine hits again':<28}{s['hit_again']:>9}/{n:<2}{n:>9}/{n:<2}",
        f"{'... within target seconds':<28}{s['within']:>9}/{n:<2}{n:>9}/{n:<2}",
        f"{'engine errors (raised)':<28}{s['engine_errors']:>12}{0:>12}",
        f"{'corrupt chunks loaded':<28}{s['corrupt']:>12}{0:>12}",
        f"{'hits again, median':<28}{sec(s['hit_seconds_median']):>12}{sec(s['hit_within_seconds']):>12}",
        f"{'hits again, max':<28}{sec(s['hit_seconds_max']):>12}{sec(s['hit_within_seconds']):>12}",
        "target met" if s["met"] else "TARGET MISSED",
    ])
