"""`kv-offload bench chaos`: fault injection (or, with --fuzz, fuzzing) against live sidecars.

Fault run: real ``kv-offload sidecar`` processes on 127.0.0.1
(``kv_offload_tools.chaos.faults``) while engines store and load verified
chunks: SIGKILL of a serving peer mid-fetch (``--kills`` engine loads cut
short, plus ``--wire-kills`` kills at a chosen byte of a fetch), SIGSTOP past
the fetch deadline, flipped, truncated and delayed bytes on the wire
(``chaos.fault_proxy``), reconnect storms, peers leaving and rejoining, a
sidecar restarting under its engine, and writes at ten times the store
budget. Then the "late writer" row (``chaos.faults.late_writer_row``, ``--late-writer-runs``
runs of each case per plane, tcp, tls, ucx and nixl, whatever ``--transport``;
``--late-writer-only`` runs it alone): a holder SIGSTOPped mid-chunk and resumed past the
fetcher's deadline, and the fetcher's loop blocked past it while the holder keeps sending (nixl:
its READ posted past the deadline); no byte may land in a slot or row after the deadline. Prints one table row per
fault class (or JSON with ``--json``),
writes a PNG (``--plot``), and exits 1 when any invariant broke: a corrupt
chunk delivered, a chunk lost that should have survived, the store above its
budget, a fault the pool did not survive, or a byte written after a deadline.

``--transport nixl`` runs the same scenarios against nixl sidecars (requests on the tcp
transport's connection, chunk bytes READ one-sidedly from the holder's store slot): the
fault proxy then damages, truncates or delays the request connection (CHUNK_AT answers:
key, checksum, slot) and marks the byte at which a holder dies, and one more fault class,
``slot_flip`` (``chaos.faults.slot_faults``, ``--slot-rounds`` rounds), flips bytes of the
holder's store slots while the hub READs them: the hub must refuse every damaged chunk by
checksum (counted), deliver none and lose none once the bytes are restored. The bench
itself READs with NIXL (its probe peers), so it needs ``nixl_cu12`` importable: without it,
one line and exit 2. UCX picks its transports (cma between processes of this host) unless
``UCX_TLS`` says otherwise.

Fuzz run (``--fuzz``): ``--fuzz-cases`` hypothesis cases against one live
sidecar (``kv_offload_tools.chaos.fuzz``); exits 1 on any wrong answer,
crash, hang or memory growth beyond ``--rss-bound-mib``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.chaos.faults.bench import BenchSettings, ChaosBench, FaultResult
from kv_offload_tools.chaos.faults.engine_faults import (
    leave_and_rejoin,
    restart_under_engine,
    sigkill_mid_fetch,
    sigstop_past_deadline,
    write_flood,
)
from kv_offload_tools.chaos.faults.late_writer_row import LateWriterResult, late_writer
from kv_offload_tools.chaos.faults.slot_faults import slot_flip
from kv_offload_tools.chaos.faults.wire_faults import (
    damaged_wire,
    reconnect_storm,
    sigkill_on_wire,
)
from kv_offload_tools.chaos.pool import CHAOS_TRANSPORTS, require_transport
from kv_offload_tools.chaos.report import (
    faults_table,
    fuzz_table,
    late_writer_table,
    plot_faults,
    plot_fuzz,
)
from kv_offload_tools.progress import timestamped


# The numeric knobs, in --help order: (flag, type, default, lowest value accepted or None where
# _check holds it to something else, help).
_KNOBS: tuple[tuple[str, type, float, int | None, str], ...] = (
    ("--seconds", float, 900.0, None, "bound on the SIGKILL loop (the longest part of a fault run), seconds"),
    ("--kills", int, 100, 1, "SIGKILLs of a serving peer that must land while a fetch is in flight"),
    ("--wire-kills", int, 20, 1, "SIGKILLs of a serving peer at a chosen byte of a fetch (through the fault proxy)"),
    ("--rounds", int, 5, 1, "rounds of SIGSTOP, reconnect storm, leave/rejoin and restart-under-engine"),
    ("--wire-rounds", int, 40, 1, "fetches through the fault proxy per wire fault (flip, truncate, delay)"),
    ("--slot-rounds", int, 40, 1, "loads during which the holder's slot bytes are flipped (--transport nixl)"),
    ("--servers", int, 3, 1, "server sidecars killed and restarted in turn"),
    ("--late-writer-runs", int, 5, 0, "runs of each late-writer case per plane (0: no late-writer row)"),
    ("--chunk-bytes", int, 64 * 1024, None, "bytes of one chunk"),
    ("--fuzz-cases", int, 10_000, 6, "hypothesis cases of a --fuzz run"),
    ("--rss-bound-mib", int, 64, 1, "largest RSS growth of the fuzzed sidecar across the run, MiB"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    p.add_argument("--fuzz", action="store_true",
                   help="fuzz every message a live sidecar accepts instead of injecting faults")
    p.add_argument("--transport", choices=CHAOS_TRANSPORTS, default="tcp",
                   help="data plane of the sidecars of a fault run (nixl adds the slot_flip fault; "
                        "default %(default)s)")
    for flag, kind, default, _, text in _KNOBS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--late-writer-only", action="store_true",
                   help="run the late-writer row alone (no other fault class)")
    p.add_argument("--plot", default="chaos.png", help="PNG to write ('' for none)")
    p.add_argument("--seed", type=int, default=1, help="seed of kill timings and fault offsets")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _check(args: argparse.Namespace) -> None:
    for flag, _, _, low, _ in _KNOBS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if low is not None and value < low:
            raise UsageError(f"{flag} {value} must be at least {low}")
    if args.seconds <= 0:
        raise UsageError(f"--seconds {args.seconds} must be positive")
    if args.chunk_bytes < 4096 or args.chunk_bytes % 4096:
        raise UsageError(f"--chunk-bytes {args.chunk_bytes} must be a positive multiple of 4096")
    if args.late_writer_only and (args.fuzz or args.late_writer_runs < 1):
        raise UsageError("--late-writer-only needs --late-writer-runs of at least 1 and no --fuzz")
    if args.fuzz and args.transport != "tcp":
        raise UsageError(f"--fuzz runs against a tcp sidecar; --transport {args.transport} applies to "
                         "the fault run")
    try:
        require_transport(args.transport)  # nixl: importable here, before any sidecar starts
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    _check(args)
    progress = timestamped("chaos", args.quiet)
    if args.fuzz:
        return _run_fuzz(args, progress)
    return _run_faults(args, progress)


# ---------------------------------------------------------------- faults


def run_faults(settings: BenchSettings, *, kills: int, wire_kills: int, seconds: float, rounds: int,
               wire_rounds: int, progress: Any, slot_rounds: int = 40) -> list[FaultResult]:
    """Every fault class once, in an order that leaves the pool usable for the next
    (``slot_flip`` on nixl only: on tcp the proxy's flips already reach the chunk bytes)."""
    with ChaosBench(settings, progress) as bench:
        results = [
            damaged_wire(bench, "flip", wire_rounds),
            damaged_wire(bench, "truncate", wire_rounds),
            damaged_wire(bench, "delay", max(1, wire_rounds // 4)),
            *([slot_flip(bench, slot_rounds)] if settings.transport == "nixl" else []),
            sigstop_past_deadline(bench, rounds),
            sigkill_mid_fetch(bench, kills, seconds),
            sigkill_on_wire(bench, wire_kills),
            reconnect_storm(bench, rounds),
            leave_and_rejoin(bench, rounds),
            restart_under_engine(bench, rounds),
            write_flood(bench, 10),
        ]
    return results


def _run_faults(args: argparse.Namespace, progress: Any) -> int:
    settings = BenchSettings(chunk_bytes=args.chunk_bytes, servers=args.servers, seed=args.seed,
                             transport=args.transport)
    started = time.monotonic()
    results: list[FaultResult] = []
    if not args.late_writer_only:
        results = run_faults(settings, kills=args.kills, wire_kills=args.wire_kills, seconds=args.seconds,
                             rounds=args.rounds, wire_rounds=args.wire_rounds, slot_rounds=args.slot_rounds,
                             progress=progress)
    late: list[LateWriterResult] = []
    if args.late_writer_runs:
        late = late_writer(args.late_writer_runs, progress)
    elapsed = time.monotonic() - started
    ok = all(r.ok for r in results) and all(r.ok for r in late)
    if args.plot:
        plot_faults(results, settings, args.plot, late)
        progress(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({"settings": asdict(settings), "seconds": round(elapsed, 1), "ok": ok,
                          "faults": [r.to_dict() for r in results],
                          "late_writer": [r.to_dict() for r in late]}, indent=2))
    else:
        if results:
            print(faults_table(results))
        if late:
            print(("\n" if results else "") + late_writer_table(late))
        print(f"\n{len(results)} fault classes on {settings.transport} sidecars, late writer on "
              f"{len(late)} planes, in {elapsed:.0f} s: {'all invariants held' if ok else 'INVARIANTS BROKEN'}")
        for r in results:
            for note in r.notes:
                print(f"- {r.fault}: {note}")
        for lw in late:
            for note in lw.notes:
                print(f"- late writer on {lw.plane}: {note}")
    return 0 if ok else 1


# ---------------------------------------------------------------- fuzz


def _run_fuzz(args: argparse.Namespace, progress: Any) -> int:
    from kv_offload_tools.chaos.fuzz.runner import FUZZ_CHUNK_BYTES, run_fuzz
    from kv_offload_tools.chaos.pool import chaos_pool

    with chaos_pool(FUZZ_CHUNK_BYTES, 64 << 20) as pool:
        progress(f"fuzzing one sidecar with {args.fuzz_cases} hypothesis cases")
        result = run_fuzz(pool, args.fuzz_cases, rss_bound_bytes=args.rss_bound_mib << 20,
                          progress=progress)
        plot_fuzz(result, args.plot)
        progress(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(fuzz_table(result))
        print(f"\n{result.cases} cases in {result.seconds:.0f} s: "
              f"{'no crash, hang, wrong answer or leak' if result.ok else 'FAILURES'}")
        for t in result.targets:
            if t.first_failure:
                print(f"- {t.target}: {t.first_failure}")
    return 0 if result.ok else 1
