"""The scenarios of ``kv-offload bench netns`` that run on pools of their own (``faults``):
``capped`` (priced and back-off-only runs), ``churn``, ``reused``, ``resolver`` and
``domain``; ``run_more`` measures the chosen ones into the bench's figures, ``report_more``
prints them."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from kv_offload_tools.bench.netns.faults import (
    FD_SLACK,
    RSS_SLACK_BYTES,
    capped_holder,
    churn,
    resolver_outage,
    reused_address,
)
from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
from kv_offload_tools.netns.pool import NetnsPool

# Pods of the capped, reused and resolver pools.
SMALL_POOL = 3
# The ``domain`` scenario's pool name and cluster domain.
DOMAIN_POOL_NAME = "kvo.ns.svc"
OTHER_DOMAIN = "cluster.example"


def run_more(args: argparse.Namespace, chosen: Sequence[str], figures: dict[str, Any],
             log: Callable[[str], None]) -> None:
    deadline = args.fetch_deadline_seconds
    if "capped" in chosen:
        figures["capped"] = {}
        for name, rate in (("priced", args.prefill_tokens_per_second), ("backoff_only", 0)):
            log(f"capped holder at {args.cap_bits} bit/s for {args.capped_seconds:g} s ({name})")
            with NetnsPool(SMALL_POOL, fetch_deadline_seconds=deadline,
                           extra_args=("--prefill-tokens-per-second", str(rate))) as pool:
                figures["capped"][name] = capped_holder(pool, SMALL_POOL - 1, args.cap_bits,
                                                        seconds=args.capped_seconds)
    if "churn" in chosen:
        log(f"churn: {args.churn_pods} pods stopped and started {args.churn_rounds} times beside 2")
        with NetnsPool(args.churn_pods + 2, fetch_deadline_seconds=deadline) as pool:
            figures["churn"] = churn(pool, stay=[0, 1], rounds=args.churn_rounds)
    if "reused" in chosen:
        log(f"reused address, listed {args.stale_seconds:g} s after its pod left")
        with NetnsPool(SMALL_POOL, fetch_deadline_seconds=deadline) as pool:
            figures["reused"] = reused_address(pool, SMALL_POOL - 1, stale_seconds=args.stale_seconds)
    if "resolver" in chosen:
        log(f"resolver down for {args.resolver_seconds:g} s")
        with NetnsPool(SMALL_POOL, fetch_deadline_seconds=deadline) as pool:
            figures["resolver"] = resolver_outage(pool, seconds=args.resolver_seconds)
    if "domain" in chosen:
        log(f"pods whose resolv.conf names {OTHER_DOMAIN}")
        with NetnsPool(SMALL_POOL, pool_name=DOMAIN_POOL_NAME, cluster_domain=OTHER_DOMAIN,
                       fetch_deadline_seconds=deadline) as pool:
            keys = chunk_keys("domain", 4)
            figures["domain"] = {"name": DOMAIN_POOL_NAME, "resolved": pool.net.resolved_name,
                                 "shared": list(share_through_pool(pool, keys, pool.chunk_bytes, holder=0,
                                                                   reader=SMALL_POOL - 1))}


def _v(v: Any) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, (int, float)) else str(v)


def report_more(f: dict[str, Any]) -> str:
    out: list[str] = []
    if "capped" in f:
        out.append(f"capped holder ({next(iter(f['capped'].values()))['rate_bits']} bit/s, fetch deadline "
                   f"{f['fetch_deadline_seconds']:g} s)")
        out.append(f"{'run':<14}{'half':<13}{'n':>5}{'hit':>7}{'p50 ms':>9}{'p99 ms':>9}{'stalled':>9}")
        for name, c in f["capped"].items():
            for half in ("first_half", "second_half"):
                s = c[half]
                out.append(f"{name:<14}{half:<13}{s['requests']:>5}{_v(s['hit_ratio']):>7}{_v(s['p50_ms']):>9}"
                           f"{_v(s['p99_ms']):>9}{s['stalled']:>9}")
            out.append(f"  {name}: decisions {c['decisions']}, largest link failure count {c['max_link_failures']}")
    if "churn" in f:
        ch = f["churn"]
        out += ["", f"churn: {ch['movers']} pods stopped and started beside {', '.join(ch['stay'])}",
                f"{'round':>5}{'left':>6}{'links live s':>14}{'forgotten s':>13}{'back s':>8}{'shared':>8}"
                f"  fds / RSS MiB of the survivors"]
        for r in ch["rounds"]:
            out.append(f"{r['round']:>5}{r['departed_links_left']:>6}{_v(r['seconds_until_links_live']):>14}"
                       f"{_v(r['seconds_until_departed_forgotten']):>13}{_v(r['seconds_until_rejoined']):>8}"
                       f"{'/'.join(map(str, r['shared'])):>8}  "
                       + ", ".join(f"{r['fds'][k]} / {r['rss_mib'][k]}" for k in r["fds"]))
        g = ch["growth_over_round_1"]
        out.append(f"  growth over round 1: {g['fds']} fds (tolerance {FD_SLACK}), {g['rss_mib']} MiB "
                   f"(tolerance {RSS_SLACK_BYTES >> 20})")
    if "reused" in f:
        r = f["reused"]
        out += ["", f"reused address {r['address']} (another pool's sidecar, listed {r['stale_seconds']:g} s)",
                f"  member refusals: {r['member_refusals']}; link states meanwhile: {r['link_states_while_listed']}",
                f"  the other pool's sidecar refused: {r['other_pool_sidecar_refusals']}",
                f"  from leaving the name's answer to no link: {_v(r['seconds_from_unlisted_to_forgotten'])} s"]
    if "resolver" in f:
        r = f["resolver"]
        out += ["", f"resolver down {r['seconds']:g} s: all pods failed to resolve after "
                f"{_v(r['seconds_until_all_failed'])} s; connected links {r['connected_before']} -> "
                f"{r['connected_during']} (lost {r['links_lost']}); shared meanwhile {r['shared_during']}"]
    if "domain" in f:
        d = f["domain"]
        out += ["", f"cluster domain: {d['name']} resolved as {d['resolved']}; shared {d['shared']}"]
    return "\n".join(out)
