"""`kv-offload bench chaos`: fault injection (or, with --fuzz, fuzzing) against live sidecars.

Fault run: real ``kv-offload sidecar`` processes on 127.0.0.1 (chaos_faults.py)
while engines store and load verified chunks: SIGKILL of a serving peer
mid-fetch (``--kills`` engine loads cut short, plus ``--wire-kills`` kills at a
chosen byte of a fetch), SIGSTOP past the fetch deadline, flipped,
truncated and delayed bytes on the wire (fault_proxy.py), reconnect storms,
peers leaving and rejoining, a sidecar restarting under its engine, and writes
at ten times the store budget. Prints one table row per fault class (or JSON
with ``--json``), writes a PNG (``--plot``), and exits 1 when any invariant
broke: a corrupt chunk delivered, a chunk lost that should have survived, the
store above its budget, or a fault the pool did not survive.

Fuzz run (``--fuzz``): ``--fuzz-cases`` hypothesis cases against one live
sidecar (chaos_fuzz.py); exits 1 on any wrong answer, crash, hang or memory
growth beyond ``--rss-bound-mib``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from kv_offload_tools.bench.chaos_faults import BenchSettings, ChaosBench, FaultResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    p.add_argument("--fuzz", action="store_true",
                   help="fuzz every message a live sidecar accepts instead of injecting faults")
    p.add_argument("--seconds", type=float, default=900.0,
                   help="bound on the SIGKILL loop (the longest part of a fault run), seconds")
    p.add_argument("--kills", type=int, default=100,
                   help="SIGKILLs of a serving peer that must land while a fetch is in flight")
    p.add_argument("--wire-kills", type=int, default=20,
                   help="SIGKILLs of a serving peer at a chosen byte of a fetch (through the fault proxy)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of SIGSTOP, reconnect storm, leave/rejoin and restart-under-engine")
    p.add_argument("--wire-rounds", type=int, default=40,
                   help="fetches through the fault proxy per wire fault (flip, truncate, delay)")
    p.add_argument("--servers", type=int, default=3, help="server sidecars killed and restarted in turn")
    p.add_argument("--chunk-bytes", type=int, default=64 * 1024, help="bytes of one chunk")
    p.add_argument("--fuzz-cases", type=int, default=10_000, help="hypothesis cases of a --fuzz run")
    p.add_argument("--rss-bound-mib", type=int, default=64,
                   help="largest RSS growth of the fuzzed sidecar across the run, MiB")
    p.add_argument("--plot", default="chaos.png", help="PNG to write ('' for none)")
    p.add_argument("--seed", type=int, default=1, help="seed of kill timings and fault offsets")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _check(args: argparse.Namespace) -> None:
    from kv_offload_operator.cli import UsageError

    for name, low in (("kills", 1), ("wire_kills", 1), ("rounds", 1), ("wire_rounds", 1), ("servers", 1),
                      ("fuzz_cases", 6), ("rss_bound_mib", 1)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {low}")
    if args.seconds <= 0:
        raise UsageError(f"--seconds {args.seconds} must be positive")
    if args.chunk_bytes < 4096 or args.chunk_bytes % 4096:
        raise UsageError(f"--chunk-bytes {args.chunk_bytes} must be a positive multiple of 4096")


def run(args: argparse.Namespace) -> int:
    _check(args)
    progress = (lambda line: None) if args.quiet else (
        lambda line: print(f"[chaos {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True))
    if args.fuzz:
        return _run_fuzz(args, progress)
    return _run_faults(args, progress)


# ---------------------------------------------------------------- faults


def run_faults(settings: BenchSettings, *, kills: int, wire_kills: int, seconds: float, rounds: int,
               wire_rounds: int, progress: Any) -> list[FaultResult]:
    """Every fault class once, in an order that leaves the pool usable for the next."""
    with ChaosBench(settings, progress) as bench:
        results = [
            bench.wire_faults("flip", wire_rounds),
            bench.wire_faults("truncate", wire_rounds),
            bench.wire_faults("delay", max(1, wire_rounds // 4)),
            bench.sigstop_past_deadline(rounds),
            bench.sigkill_mid_fetch(kills, seconds),
            bench.sigkill_on_wire(wire_kills),
            bench.reconnect_storm(rounds),
            bench.discovery_churn(rounds),
            bench.restart_under_engine(rounds),
            bench.write_flood(10),
        ]
    return results


def _run_faults(args: argparse.Namespace, progress: Any) -> int:
    settings = BenchSettings(chunk_bytes=args.chunk_bytes, servers=args.servers, seed=args.seed)
    started = time.monotonic()
    results = run_faults(settings, kills=args.kills, wire_kills=args.wire_kills, seconds=args.seconds,
                         rounds=args.rounds,
                         wire_rounds=args.wire_rounds, progress=progress)
    elapsed = time.monotonic() - started
    ok = all(r.ok for r in results)
    if args.plot:
        plot_faults(results, settings, args.plot)
        progress(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({"settings": _settings_dict(settings), "seconds": round(elapsed, 1),
                          "ok": ok, "faults": [r.to_dict() for r in results]}, indent=2))
    else:
        print(faults_table(results))
        print(f"\n{len(results)} fault classes in {elapsed:.0f} s: "
              f"{'all invariants held' if ok else 'INVARIANTS BROKEN'}")
        for r in results:
            for note in r.notes:
                print(f"- {r.fault}: {note}")
    return 0 if ok else 1


def _settings_dict(settings: BenchSettings) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(settings)


def faults_table(results: Sequence[FaultResult]) -> str:
    """The figures as a markdown table."""
    head = ("| fault | injected | in flight | survived | loads | loads turned into misses | "
            "corrupt chunks delivered | chunks lost | chunks refused by checksum | "
            "worst give-up (s) | store peak / budget |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        store = (f"{r.store_peak_bytes / 2**20:.2f} / {r.store_budget_bytes / 2**20:.2f} MiB"
                 if r.store_budget_bytes else "-")
        lines.append(f"| {r.fault} | {r.injected} | {r.in_flight} | {r.survived} | {r.loads} | "
                     f"{r.loads_missed} | {r.corrupt_delivered} | {r.lost} | {r.integrity_rejected} | "
                     f"{r.worst_give_up_seconds:.3f} | {store} |")
    return "\n".join(lines)


def plot_faults(results: Sequence[FaultResult], settings: BenchSettings, path: str) -> None:
    """Three panels: faults injected/survived, worst give-up vs the deadline, store bytes vs budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    names = [r.fault for r in results]
    xs = range(len(results))
    ax = axes[0]
    ax.bar([x - 0.2 for x in xs], [r.injected for r in results], 0.4, label="injected")
    ax.bar([x + 0.2 for x in xs], [r.survived for r in results], 0.4, label="survived")
    for x, r in zip(xs, results):
        if r.corrupt_delivered or r.lost:
            ax.annotate(f"corrupt {r.corrupt_delivered}\nlost {r.lost}", (x, r.injected),
                        ha="center", va="bottom", color="red", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("faults")
    ax.set_title("Faults injected and survived (red: corrupt or lost chunks)")
    ax.legend()
    ax = axes[1]
    ax.bar(list(xs), [r.worst_give_up_seconds for r in results], color="tab:orange")
    ax.axhline(settings.fetch_deadline_seconds, color="black", linestyle="--",
               label=f"fetch deadline {settings.fetch_deadline_seconds:g} s")
    ax.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Worst time for a load or fetch to give up")
    ax.legend()
    ax = axes[2]
    flood = next((r for r in results if r.series.get("store_used_bytes")), None)
    if flood is not None:
        ts, used = zip(*flood.series["store_used_bytes"])
        ax.plot(ts, [u / 2**20 for u in used], label="store bytes in use")
        ax.axhline(flood.store_budget_bytes / 2**20, color="red", linestyle="--", label="budget")
        ax.set_xlabel("seconds into the 10x write flood")
        ax.set_ylabel("MiB")
        ax.legend(loc="lower right")
    ax.set_title("Store bytes in use vs budget (10x writes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- fuzz


def _run_fuzz(args: argparse.Namespace, progress: Any) -> int:
    from kv_offload_tools.bench.chaos_fuzz import FUZZ_CHUNK_BYTES, run_fuzz
    from kv_offload_tools.bench.chaos_support import ChaosPool

    with ChaosPool(chunk_bytes=FUZZ_CHUNK_BYTES, capacity_bytes=64 << 20) as pool:
        progress(f"fuzzing one sidecar with {args.fuzz_cases} hypothesis cases")
        result = run_fuzz(pool, args.fuzz_cases, rss_bound_bytes=args.rss_bound_mib << 20,
                          progress=progress)
    if args.plot:
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


def fuzz_table(result: Any) -> str:
    """The fuzz figures as a markdown table."""
    lines = ["| message | cases | correct answers | clear errors | incomplete input | failures |",
             "|---|---|---|---|---|---|"]
    for t in result.targets:
        lines.append(f"| {t.target} | {t.cases} | {t.answers} | {t.errors} | {t.incomplete} | {t.failures} |")
    lines.append(f"| **total** | {result.cases} | {sum(t.answers for t in result.targets)} | "
                 f"{sum(t.errors for t in result.targets)} | {sum(t.incomplete for t in result.targets)} | "
                 f"{result.failures} |")
    lines.append("")
    lines.append(f"Sidecar crashes: {result.crashes}; hangs: {result.hangs}; RSS "
                 f"{result.rss_start_bytes / 2**20:.1f} MiB after warm-up, "
                 f"{result.rss_end_bytes / 2**20:.1f} MiB at the end (peak "
                 f"{result.rss_peak_bytes / 2**20:.1f} MiB, bound +{result.rss_bound_bytes / 2**20:.0f} MiB).")
    return "\n".join(lines)


def plot_fuzz(result: Any, path: str) -> None:
    """Cases per message by outcome, and the sidecar's RSS across the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    names = [t.target for t in result.targets]
    bottom = [0] * len(names)
    for label, attr in (("correct answer", "answers"), ("clear error", "errors"),
                        ("incomplete input", "incomplete"), ("failure", "failures")):
        vals = [getattr(t, attr) for t in result.targets]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("cases")
    ax.set_title(f"{result.cases} fuzz cases by outcome")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=8)
    ax = axes[1]
    if result.rss_series:
        xs, rss = zip(*result.rss_series)
        ax.plot(xs, [r / 2**20 for r in rss], label="sidecar RSS")
        ax.axhline((result.rss_start_bytes + result.rss_bound_bytes) / 2**20, color="red",
                   linestyle="--", label="bound")
        ax.set_ylim(0, (result.rss_start_bytes + result.rss_bound_bytes) / 2**20 * 1.1)
    ax.set_xlabel("cases")
    ax.set_ylabel("MiB")
    ax.set_title("Sidecar memory across the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
