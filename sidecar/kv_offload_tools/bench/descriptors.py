"""`kv-offload bench descriptors`: the demo's hit ratio with every process past 1,024 descriptors.

A sidecar of a large pool, and vLLM's own process, hold more than ``FD_SETSIZE`` (1,024)
descriptors; ``select.select`` fails for any descriptor above that, so a code path that
still used it would fail its lookups there and nowhere else. This bench runs ``kv-offload
demo`` twice in one invocation, side by side on the same trace requests: once as it is,
once with every process of the pool holding ``--descriptors`` open descriptors (each sidecar
through ``many_descriptors.launcher``, the engines' process, where the tier runs, through
``many_descriptors.holding``), so every socket either opens lands above 1,024. Prints both
hit ratios, their ratio (target ``TARGET_RATIO``, issue 48) and the loads that failed;
``--json`` prints one object. Exit code 1 when a loaded byte differed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.demo import DemoReport, run_demo
from kv_offload_tools.many_descriptors import PAST_FD_SETSIZE, holding, launcher
from kv_offload_tools.progress import to_stderr

# With descriptors held, the hit ratio is at least this share of the one without (issue 48).
TARGET_RATIO = 0.9


@dataclass(frozen=True)
class Run:
    """One demo run's figures."""

    # Descriptors every process held open (0: none).
    descriptors: int
    # Requests replayed.
    requests: int
    # Chunk hits (local and peer) over chunks looked up.
    hit_ratio: float
    # Hits loaded from a peer pod.
    peer_hits: int
    # Load jobs that failed in whole or part.
    failed_loads: int
    # Loaded bytes that differed from the KV the engines compute (must be 0).
    mismatched_bytes: int

    @classmethod
    def of(cls, descriptors: int, report: DemoReport) -> Run:
        t = report.total
        return cls(descriptors, report.requests, t.hit_ratio, t.peer_hits, t.failed_loads, t.mismatched_bytes)


def compare(pods: int, requests: int, descriptors: int, seconds: float) -> dict[str, Any]:
    """Both runs, without then with the descriptors held; their figures and the ratio."""
    to_stderr(f"[bench descriptors] demo of {pods} pods, {requests} requests, nothing held")
    plain = Run.of(0, run_demo(pods, requests, seconds=seconds, progress=to_stderr))
    to_stderr(f"[bench descriptors] the same with {descriptors} descriptors held in every process")
    with holding(descriptors):
        held = Run.of(descriptors, run_demo(pods, requests, seconds=seconds, progress=to_stderr,
                                            launcher=launcher(descriptors)))
    ratio = held.hit_ratio / plain.hit_ratio if plain.hit_ratio else 0.0
    return {"runs": [asdict(plain), asdict(held)], "ratio": ratio, "target_ratio": TARGET_RATIO,
            "met": ratio >= TARGET_RATIO and held.failed_loads <= plain.failed_loads}


def format_table(figures: dict[str, Any]) -> str:
    lines = [f"{'descriptors held':>16} {'requests':>8} {'hit ratio':>9} {'peer hits':>9} "
             f"{'failed loads':>12} {'mismatched':>10}"]
    for r in figures["runs"]:
        lines.append(f"{r['descriptors']:>16} {r['requests']:>8} {r['hit_ratio']:>9.3f} {r['peer_hits']:>9} "
                     f"{r['failed_loads']:>12} {r['mismatched_bytes']:>10}")
    lines.append(f"hit ratio with / without: {figures['ratio']:.3f} (target >= {figures['target_ratio']}, "
                 f"no more failed loads): {'met' if figures['met'] else 'NOT met'}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=3, help="pods of the demo (default 3)")
    parser.add_argument("--requests", type=int, default=300, help="trace requests per run (default 300)")
    parser.add_argument("--descriptors", type=int, default=PAST_FD_SETSIZE,
                        help=f"descriptors every process holds in the second run (default {PAST_FD_SETSIZE})")
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="stop each run's requests after this many seconds (default 120)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    if args.pods < 2:
        raise UsageError(f"--pods {args.pods}: at least 2, so pods share chunks")
    if args.requests < 1:
        raise UsageError(f"--requests {args.requests}: at least 1")
    if args.descriptors < 1:
        raise UsageError(f"--descriptors {args.descriptors}: at least 1 (1,100 puts sockets past 1,024)")
    if args.seconds <= 0:
        raise UsageError(f"--seconds {args.seconds}: must be positive")
    figures = compare(args.pods, args.requests, args.descriptors, args.seconds)
    print(json.dumps(figures, indent=1) if args.json else format_table(figures))
    return 1 if any(r["mismatched_bytes"] for r in figures["runs"]) else 0
