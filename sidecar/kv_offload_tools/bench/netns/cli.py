"""`kv-offload bench netns`: today's behaviour of a pool under silent partitions, measured.

Real ``kv-offload sidecar`` processes, one per pod network namespace behind a router
namespace (``kv_offload_tools.netns``: ``--pods`` pods, found by the pool name through
each pod's hosts file), tcp data plane, while every pod's engine stores fresh chunks and
reads other pods' (``load``). Three scenarios (``scenarios``), in this order:

1. ``isolate``: one pod silently cut from all others both ways (packets dropped, no
   answer) for ``--cut-seconds``, then healed: per-request hit ratio and p50/p99 engine
   wait of the requests for its chunks before, during and after (and what the cut added),
   the same for its own reads and for everyone else's; seconds until the pool stops
   calling it connected and until the last request that waited on it; seconds from the heal
   until it is connected again and its chunks hit whole; half-open TCP connections (``ss``
   inside the namespaces) at the end of the cut, once reconnected, and at the end;
2. ``idle``: the same cut while nothing asks the pod, ``--idle-seconds`` long: whether the
   pool notices at all, and how long a lookup of its chunks then waits;
3. ``asymmetric``: pod 0 cannot reach pod 1's control port, pod 1 reaches pod 0; pod 2
   stores, every other pod reads: per reader, the hit share of pod 2's chunks before and
   during, and which peers each sidecar calls connected.

Then, each on a pool of its own (``faults``; ``--scenarios`` picks some):

4. ``capped``: the last pod stores behind a ``--cap-bits`` tbf cap for ``--capped-seconds``
   while the others read, twice: with ``--prefill-tokens-per-second`` (priced out) and with
   none (backed off only): per half of the window, requests, p50/p99 and those that waited
   half the deadline or more; fetch decisions; the largest failure count of a link to it;
5. ``churn``: ``--churn-pods`` pods stopped and started ``--churn-rounds`` times beside 2 that
   stay: per round, links left connected to departed pods, seconds until the departed
   addresses are forgotten and until the pods are back, the survivors' descriptors and RSS;
6. ``reused``: a departed pod's address taken by a sidecar of another pool while the pool name
   still lists it for ``--stale-seconds``: refusals per reason on each side, link states, and
   seconds from its leaving the name's answer until no member has a link to it;
7. ``resolver``: every pod's resolver fails for ``--resolver-seconds``: links lost and a share
   between two pods meanwhile; ``domain``: pods whose resolv.conf names ``cluster.example``
   find each other by a ``.svc`` name.

Figures, not pass/fail: it exits 0 once measured (1 when a chunk came back wrong or the
load failed). Prints a table, or JSON with ``--json``. Needs root on Linux (network
namespaces); elsewhere, or on bad input, one line on stderr and exit 2. About
``--before-seconds`` * 2 + ``--cut-seconds`` + ``--after-seconds`` + ``--idle-seconds`` +
``--asym-seconds`` plus start-up (a minute with the defaults), then 2 * ``--capped-seconds``,
about 20 s per churn round, ``--stale-seconds`` + 15 s and ``--resolver-seconds`` + 15 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.bench import require_host
from kv_offload_tools.bench.number_flags import add_number_flags, check_number_flags
from kv_offload_tools.progress import rows_to

# (flag, default, lowest, help)
_FLOATS = (
    ("--before-seconds", 5.0, 2.0, "load before each cut (the reference window)"),
    ("--cut-seconds", 10.0, 1.0, "how long the isolated pod stays cut off"),
    ("--after-seconds", 10.0, 1.0, "load after the heal"),
    ("--idle-seconds", 15.0, 1.0, "how long the idle cut waits for the pool to notice"),
    ("--asym-seconds", 10.0, 1.0, "how long the asymmetric partition lasts"),
    ("--fetch-deadline-seconds", 2.0, 0.1, "the sidecars' --fetch-deadline-seconds"),
    ("--capped-seconds", 12.0, 2.0, "how long the capped holder serves its chunks"),
    ("--stale-seconds", 5.0, 0.0, "how long the pool name still lists a reused address"),
    ("--resolver-seconds", 15.0, 0.0, "how long every pod's resolver fails"),
)
# (flag, default, lowest, help)
_INTS = (
    ("--cap-bits", 256_000, 8_000, "bandwidth cap of the capped holder, bits per second"),
    ("--prefill-tokens-per-second", 512, 1, "prefill rate the capped run's sidecars are given"),
    ("--churn-pods", 8, 1, "pods stopped and started beside the 2 that stay"),
    ("--churn-rounds", 3, 1, "how many times they are stopped and started"),
)
SCENARIOS = ("isolate", "capped", "churn", "reused", "resolver", "domain")
MAX_PODS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=4, help=f"pods in the pool, 3 to {MAX_PODS} (default 4)")
    add_number_flags(parser, _FLOATS + _INTS)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated scenarios to run, of {', '.join(SCENARIOS)} (default all; "
                             "isolate also runs idle and asymmetric on its pool)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")


def _check(args: argparse.Namespace) -> None:
    if not 3 <= args.pods <= MAX_PODS:
        raise UsageError(f"--pods {args.pods} must be between 3 and {MAX_PODS}")
    check_number_flags(args, _FLOATS + _INTS)
    if args.churn_pods + 2 > MAX_PODS:
        raise UsageError(f"--churn-pods {args.churn_pods} must be at most {MAX_PODS - 2}")
    unknown = sorted(set(args.scenarios.split(",")) - set(SCENARIOS))
    if unknown or not args.scenarios:
        raise UsageError(f"--scenarios {args.scenarios!r}: unknown {', '.join(unknown) or 'empty'}; "
                         f"valid: {', '.join(SCENARIOS)}")
    from kv_offload_tools.netns.ip import unavailable
    require_host("netns", unavailable())


def run(args: argparse.Namespace) -> int:
    _check(args)

    log = rows_to(args.json)
    chosen = args.scenarios.split(",")
    figures: dict[str, Any] = {"pods": args.pods, "fetch_deadline_seconds": args.fetch_deadline_seconds}
    if "isolate" in chosen:
        _partitions(args, figures, log)
    from kv_offload_tools.bench.netns.more import run_more
    run_more(args, chosen, figures, log)
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
    else:
        print(report(figures))
    wrong = sum(w["wrong"] for kind in ("victims_chunks", "victims_reads", "others")
                for w in figures.get("isolate", {}).get(kind, {}).values() if "wrong" in w)
    errors = [e for key in ("isolate", "asymmetric") for e in figures.get(key, {}).get("errors", [])]
    errors += [e for run in figures.get("capped", {}).values() for e in run["errors"]]
    return 1 if wrong or errors else 0


def _partitions(args: argparse.Namespace, figures: dict[str, Any], log: Any) -> None:
    """The isolate, idle and asymmetric scenarios, on one pool of ``--pods``."""
    from kv_offload_tools.bench.netns.scenarios import (
        asymmetric,
        isolate_and_heal,
        isolate_idle,
    )
    from kv_offload_tools.netns.pool import NetnsPool

    victim = args.pods - 1
    with NetnsPool(args.pods, fetch_deadline_seconds=args.fetch_deadline_seconds) as pool:
        log(f"{args.pods} pods up; isolating {pool[victim].identity} for {args.cut_seconds:g} s")
        figures["isolate"] = isolate_and_heal(pool, victim, before=args.before_seconds,
                                              during=args.cut_seconds, after=args.after_seconds)
        figures["isolate"]["victim"] = pool[victim].identity
        figures["reconverged"] = _reconverged(pool)
        log(f"idle cut of {pool[victim].identity} for up to {args.idle_seconds:g} s")
        figures["idle"] = isolate_idle(pool, victim, 0, seconds=args.idle_seconds)
        figures["reconverged_after_idle"] = _reconverged(pool)
        log(f"asymmetric partition for {args.asym_seconds:g} s")
        figures["asymmetric"] = asymmetric(pool, 0, 1, 2, before=args.before_seconds, during=args.asym_seconds)


def _reconverged(pool: Any) -> str:
    """"yes", or what the pool still lacked 30 s after a heal."""
    try:
        pool.wait_connected(30)
        pool.wait_directory_current(30)
    except TimeoutError as exc:
        return " ".join(str(exc).split())
    return "yes"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:g}"


def report(f: dict[str, Any]) -> str:
    """The figures as text tables."""
    from kv_offload_tools.bench.netns.more import report_more

    more = report_more(f)
    if "isolate" not in f:
        return more
    return _report_partitions(f) + ("\n\n" + more if more else "")


def _report_partitions(f: dict[str, Any]) -> str:
    iso = f["isolate"]
    out = [f"isolate {iso['victim']} of {f['pods']} pods (fetch deadline {f['fetch_deadline_seconds']:g} s)",
           f"{'requests':<16}{'window':<8}{'n':>6}{'hit':>8}{'p50 ms':>10}{'p99 ms':>10}"]
    for kind in ("victims_chunks", "victims_reads", "others"):
        for w in ("before", "during", "after"):
            s = iso[kind][w]
            out.append(f"{kind:<16}{w:<8}{s['requests']:>6}{_ms(s['hit_ratio']):>8}"
                       f"{_ms(s['p50_ms']):>10}{_ms(s['p99_ms']):>10}")
        if "added" in iso[kind]:
            a = iso[kind]["added"]
            out.append(f"{kind:<16}{'added':<8}{'':>6}{'':>8}{_ms(a['p50_ms']):>10}{_ms(a['p99_ms']):>10}")
    out += [f"  {k}: {_ms(v)}" for k, v in iso["timeline_s"].items()]
    out += [f"  half-open connections {k}: {v}" for k, v in iso["half_open"].items()]
    out.append(f"  directory reconverged after the heal: {f['reconverged']}")
    idle = f["idle"]
    out += ["", f"idle cut ({idle['seconds']:g} s, nothing asks it): all drop it after "
            f"{_ms(idle['cut_to_all_drop_it'])} s; still connected to it: {idle['still_connected_to_it']}; "
            f"a lookup of its chunks then waited {_ms(idle['lookup_after_ms'])} ms ({idle['lookup_hits']} hits)",
            f"  directory reconverged after the heal: {f['reconverged_after_idle']}"]
    asym = f["asymmetric"]
    out += ["", f"asymmetric: {asym['a']} cannot reach {asym['b']}'s control port; {asym['c']} stores",
            f"{'reader':<10}{'hit before':>12}{'hit during':>12}{'p99 during ms':>15}{'members seen':>14}"
            f"{'unreachable':>13}  connected"]
    for pod, s in asym["readers"].items():
        out.append(f"{pod:<10}{_ms(s['before']['hit_ratio']):>12}{_ms(s['during']['hit_ratio']):>12}"
                   f"{_ms(s['during']['p99_ms']):>15}{asym['members_seen'][pod]:>14}"
                   f"{_ms(asym['unreachable_peers'][pod]):>13}  "
                   f"{','.join(asym['connected_views'][pod])}")
    return "\n".join(out)
