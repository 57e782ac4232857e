"""`kv-offload bench attack`: hostile clients against a live pool, while it serves an honest load.

Real ``kv-offload sidecar`` processes of one pool on 127.0.0.1 (``--members``,
default 3) serve an honest load (``honest``: one member's engine stores,
another's looks up and loads, every byte verified). After a warm-up, the load
runs ``--baseline-seconds`` without attackers, then strangers (source addresses
127.0.0.2 ...) attack the member the load fetches from, one class after the other:

1. the siege (``siege``): up to ``--connections`` (1,000) hostile connections
   held at once: silent floods of the control and data ports, slow headers, slow
   bodies, 1 MiB announced authentication frames;
2. one-shot probes of the control port (``control``): 70 kB request lines
   and headers, 300 headers, 9 kB bearer tokens, deeply nested JSON and 5000-digit
   integers in handshake bodies, a 200 kB ``step``, a flood of rejected handshakes,
   other wire versions (nothing may be said before the proof), replayed steps of a
   member's real handshake, a flood of step 1s carrying the pool's real key id (readable
   by anyone on the pod network) while a member keeps handshaking;
3. the data port and the local channel (``wire``): malformed and oversized
   frames before authentication, garbage frames on the engine's Unix socket; and a
   real sidecar of another pool (another key) trying to join, and a key holder whose
   engine runs other weights under the same name and path asking for the honest chunks.

Once the attackers are gone and the target's descriptors are back, the load runs half
as long again without attackers: both quiet runs together are the reference of the
hit ratio and p99 (the host's other load drifts; a single run before would blame
that drift on the attacks).

It reports, per attack, what came back, the connections the sidecar cut, the
counters that moved, log bytes, tracebacks, 500s, the target's RSS and descriptor
peak and the honest load in that window; for the pool, each member's RSS and
descriptors before, at peak and after, log growth per minute, tracebacks (and
where they were raised), members alive and connected, and the honest hit ratio and
p99 load time against the run without attackers. PASS/FAIL lines for the targets of
issue 25 (``report``); ``--json``; a PNG (``--plot``). Exit 0 when every
target holds, 1 otherwise. Bounded: at most ``--connections`` hostile connections
at once, every exchange times out, the siege holds ``--hold-seconds`` at most, the
one-shot attacks stop at a time budget (``ATTACK_BUDGET_SECONDS``); ``--short`` runs the
whole in about a minute.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.bench.attack import control as attack_control
from kv_offload_tools.bench.attack import wire as attack_wire
from kv_offload_tools.bench.attack.context import AttackContext
from kv_offload_tools.bench.attack.honest import HonestLoad
from kv_offload_tools.bench.attack.pool import PoolWatch, attack_pool
from kv_offload_tools.bench.attack.report import (
    counters_lines,
    plot,
    pool_figures,
    pool_lines,
    table,
    targets,
)
from kv_offload_tools.bench.attack.siege import run_siege
from kv_offload_tools.bench.attack.sockets import sources
from kv_offload_tools.progress import timestamped

# Values of a full run and of --short, for the flags left unset.
FULL = {"connections": 1000, "hold_seconds": 15.0, "repeats": 20, "rejected_handshakes": 200,
        "sniffed_step1s": 5000, "warmup_seconds": 8.0, "baseline_seconds": 30.0}
SHORT = {"connections": 200, "hold_seconds": 6.0, "repeats": 3, "rejected_handshakes": 40,
         "sniffed_step1s": 300, "warmup_seconds": 4.0, "baseline_seconds": 10.0}
# Seconds the one-shot attacks may take together (each exchange times out on its own;
# past this budget the remaining rounds are skipped and noted).
ATTACK_BUDGET_SECONDS = {"full": 600.0, "short": 120.0}
# Seconds the bench waits after the attacks for the target's descriptors to come back.
SETTLE_SECONDS = 20.0
# Bytes of one honest chunk, and each member's store budget.
CHUNK_BYTES = 16 * 1024
CAPACITY_BYTES = 8 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    p.add_argument("--short", action="store_true",
                   help="small counts and windows (about a minute): " + ", ".join(
                       f"{k.replace('_', '-')} {v:g}" for k, v in SHORT.items()))
    p.add_argument("--connections", type=int, help=f"hostile connections held at once in the siege, "
                   f"at most 1000 (default {FULL['connections']})")
    p.add_argument("--hold-seconds", type=float,
                   help=f"seconds the siege holds them all at most (it ends once the sidecar cut every "
                        f"one; default {FULL['hold_seconds']:g})")
    p.add_argument("--repeats", type=int, help=f"times each one-shot probe is sent (default {FULL['repeats']})")
    p.add_argument("--rejected-handshakes", type=int,
                   help=f"strangers' step 1s of the rejection flood (default {FULL['rejected_handshakes']})")
    p.add_argument("--sniffed-step1s", type=int,
                   help=f"step 1s carrying the pool's real key id, sent for "
                        f"{attack_control.FLOOD_SECONDS:g} s at most (default {FULL['sniffed_step1s']}; "
                        f"the sidecar keeps up to 4096 pending)")
    p.add_argument("--warmup-seconds", type=float,
                   help=f"honest load before anything is measured (default {FULL['warmup_seconds']:g})")
    p.add_argument("--baseline-seconds", type=float,
                   help=f"honest load without attackers (default {FULL['baseline_seconds']:g})")
    p.add_argument("--sources", type=int, default=16,
                   help="source addresses 127.0.0.2 ... the attackers use (default %(default)s)")
    p.add_argument("--members", type=int, default=3, help="sidecars of the pool (default %(default)s)")
    p.add_argument("--transport", choices=("tcp", "nixl", "ucx"), default="tcp",
                   help="data plane of the pool (ucx: its address is only told after the proof, so the "
                        "data-port attacks are skipped; default %(default)s)")
    p.add_argument("--plot", default="attack.png", help="PNG to write ('' for none)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    base = SHORT if args.short else FULL
    s = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    for name, low, high in (("connections", 5, 1000), ("repeats", 1, 1000), ("rejected_handshakes", 1, 10_000),
                            ("sniffed_step1s", 1, 20_000)):
        if not low <= s[name] <= high:
            raise UsageError(f"--{name.replace('_', '-')} {s[name]} must be in {low}..{high}")
    for name in ("hold_seconds", "warmup_seconds", "baseline_seconds"):
        if not 0 < s[name] <= 600:
            raise UsageError(f"--{name.replace('_', '-')} {s[name]:g} must be in (0, 600] seconds")
    if not 1 <= args.sources <= 200:
        raise UsageError(f"--sources {args.sources} must be in 1..200")
    if not 2 <= args.members <= 8:
        raise UsageError(f"--members {args.members} must be in 2..8 (one stores, another loads)")
    if args.transport == "nixl":
        from kv_offload_tools.chaos.pool import require_transport

        try:
            require_transport("nixl")
        except ValueError as exc:
            raise UsageError(str(exc).replace("bench chaos", "bench attack")) from None
    return {**s, "sources": args.sources, "members": args.members, "transport": args.transport,
            "short": args.short}


def _raise_fd_limit(need: int) -> None:
    """Room for the siege's sockets here and in the sidecars (they inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def run(args: argparse.Namespace) -> int:
    s = _settings(args)
    progress = timestamped("attack", args.quiet)
    _raise_fd_limit(4 * s["connections"] + 1024)
    report = measure(s, progress)
    if args.plot:
        plot(report, report.pop("_series"), args.plot)
        progress(f"wrote {args.plot}")
    report.pop("_series", None)
    ok = all(t["pass"] for t in report["targets"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if ok else 1


def measure(s: dict[str, Any], progress: Any) -> dict[str, Any]:
    """Start the pool, run the honest load and every attack; the report (with ``_series``)."""
    started = time.monotonic()
    progress(f"starting {s['members']} {s['transport']} sidecars on 127.0.0.1")
    with attack_pool(s["members"], CHUNK_BYTES, CAPACITY_BYTES, s["transport"]) as pool:
        target, reader_sc = pool[0], pool[1]
        writer = pool.client(0)  # for its local channel's path (the local-channel attacks)
        watch = PoolWatch(pool)
        honest = HonestLoad((target.host, target.port), (reader_sc.host, reader_sc.port), pool.chunk_bytes)
        watch.start()
        honest.start()
        try:
            progress(f"honest load: {target.identity} stores, {reader_sc.identity} loads; "
                     f"warm-up {s['warmup_seconds']:g} s, then {s['baseline_seconds']:g} s without attackers")
            time.sleep(s["warmup_seconds"])
            t0 = time.monotonic()
            time.sleep(s["baseline_seconds"])
            t1 = time.monotonic()
            baseline = honest.stats(t0, t1)
            progress(f"without attackers: hit ratio {baseline['hit_ratio']:.4f}, "
                     f"p99 load {baseline['load_p99_ms']:.1f} ms over {baseline['rounds']} rounds")
            before = watch.sample()
            ctx = AttackContext(pool, target, target.status()["data_address"], writer.socket_path,
                                sources(s["sources"]), watch, honest, progress, s["repeats"],
                                s["rejected_handshakes"])
            ctx.deadline = time.monotonic() + ATTACK_BUDGET_SECONDS["short" if s["short"] else "full"]
            leaked, replays, other_weights_bytes = _attacks(ctx, s)
            t2 = time.monotonic()
            attacked = honest.stats(t1, t2)
            after = _settle(watch, before, progress)
            connected = watch.connected(timeout=SETTLE_SECONDS)
            t3 = time.monotonic()  # a second run without attackers, as long as half the first
            progress(f"{s['baseline_seconds'] / 2:g} s more without attackers")
            time.sleep(s["baseline_seconds"] / 2)
            t4 = time.monotonic()
            before_only, after_only = baseline, honest.stats(t3, t4)
            baseline = honest.stats(t0, t1, (t3, t4))
            peak = {ident: (watch.peak(ident, t1, after.at, 0), watch.peak(ident, t1, after.at, 1))
                    for ident in before.members}
            log_bytes = sum(after.members[i][2] - before.members[i][2] for i in before.members)
        finally:
            honest.stop()
            watch.stop()
            writer.close()
        tracebacks = watch.tracebacks()
    results = [r.to_dict(t0) for r in ctx.results]
    pool_fig = pool_figures(before, peak, after, log_bytes, after.at - before.at)
    report = {
        "settings": s, "seconds": round(time.monotonic() - started, 1),
        "baseline_windows": [[0.0, round(t1 - t0, 2)], [round(t3 - t0, 2), round(t4 - t0, 2)]],
        "honest": {"without_attackers": baseline, "under_attack": attacked,
                   "without_attackers_before": before_only, "without_attackers_after": after_only,
                   "not_stored": honest.not_stored,
                   "error": honest.error},
        "attacks": results, "pool": pool_fig, "connected": connected,
        "server_headers": sorted(ctx.server_headers), "during_siege": ctx.during_siege,
        "tracebacks": {k: _count(v) for k, v in tracebacks.items()},
        "targets": targets(pool_fig, results, tracebacks, connected, baseline, attacked,
                           ctx.siege_connections, leaked, replays, other_weights_bytes),
        "_series": _series(watch, honest, t0),
    }
    return report


def _attacks(ctx: AttackContext, s: dict[str, Any]) -> tuple[bool, int, int]:
    run_siege(ctx, s["connections"], s["hold_seconds"])
    for attack in (attack_control.public_metrics, attack_control.oversized_http, attack_control.deep_json,
                   attack_control.huge_integers,
                   attack_control.malformed_step, attack_control.rejected_flood):
        attack(ctx)
    leaked = attack_control.other_wire_version(ctx)
    replays = attack_control.replayed_steps(ctx)
    attack_control.sniffed_key_id_flood(ctx, s["sniffed_step1s"])
    attack_wire.data_frames(ctx)
    attack_wire.local_garbage(ctx)
    attack_wire.other_pool_member(ctx)
    other_weights_bytes = attack_wire.other_weights_member(ctx)
    return leaked, replays, other_weights_bytes


def _settle(watch: PoolWatch, before: Any, progress: Any) -> Any:
    """The first sample at which every member's descriptors are back within 16 of before
    (or the last one after SETTLE_SECONDS)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        s = watch.sample()
        high = {i: s.members[i][1] - before.members[i][1] for i in before.members}
        if all(v <= 16 for v in high.values()):
            return s
        if time.monotonic() > deadline:
            progress(f"descriptors still above their value before the attacks: {high}")
            return s
        time.sleep(0.25)


def _count(lines: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in lines:
        out[line] = out.get(line, 0) + 1
    return out


def _series(watch: PoolWatch, honest: HonestLoad, t0: float) -> dict[str, Any]:
    samples = [x for x in watch.series() if x.at >= t0 - 1]
    idents = list(samples[0].members) if samples else []
    return {
        "rss": {i: [(x.at - t0, x.members[i][0]) for x in samples] for i in idents},
        "fds": {i: [(x.at - t0, x.members[i][1]) for x in samples] for i in idents},
        "gauges": {k: [(t - t0, v) for t, v in pts] for k, pts in watch.gauge_series.items()},
        "loads": [(r.at - t0, 1e3 * r.load_seconds) for r in honest.rounds if r.at >= t0 - 1],
    }


def render(report: dict[str, Any]) -> str:
    h = report["honest"]
    b, a = h["without_attackers"], h["under_attack"]
    lines = [table(report["attacks"]), "", *pool_lines(report["pool"]), "",
             f"honest load: hit ratio {a['hit_ratio'] or 0:.4f} under attack vs {b['hit_ratio'] or 0:.4f} without "
             f"({a['rounds']} vs {b['rounds']} rounds, {a['wrong']} wrong chunks); p99 load "
             f"{a['load_p99_ms']:.1f} ms vs {b['load_p99_ms']:.1f} ms; p50 {a['load_p50_ms']:.1f} vs "
             f"{b['load_p50_ms']:.1f} ms",
             f"  (without attackers: before {h['without_attackers_before']['load_p99_ms']:.1f} ms, after "
             f"{h['without_attackers_after']['load_p99_ms']:.1f} ms p99; both runs together are the reference)",
             ""]
    if h["error"]:
        lines.append(f"honest load stopped early: {h['error']}")
    for what, answer in report["during_siege"].items():
        lines.append(f"while the siege held everything, {what}: {answer}")
    lines.append("")
    lines += counters_lines(report["attacks"])
    for server in report["server_headers"]:
        lines.append(f"- the control port's Server header: {server}")
    for ident, tbs in report["tracebacks"].items():
        for where, n in tbs.items():
            lines.append(f"traceback x{n} in {ident}: {where}")
    lines.append("")
    for t in report["targets"]:
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['measured']}")
    return "\n".join(lines)
