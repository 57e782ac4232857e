"""More scenarios of ``kv-offload bench netns``: a holder behind a slow link, pods that come and
go, an address taken over by another pool, and a resolver that stops answering. Each returns
plain figures (a dict), measured on a started NetnsPool; the tests in ``tests/tools/netns`` run
them short and assert on the figures.

``capped_holder``: pod ``holder`` stores, every other pod reads, while the holder's veth is
capped (``PodNetwork.cap_bandwidth``, tbf) so low that a batch cannot arrive within the fetch
deadline. The contract (issue 48): a fetch that ran out of its deadline is priced as a transfer
at the rate it managed (``peers.fetch_cost``), so with a prefill rate configured the holder is
priced out after its first deadline; without one, the engine path's failures keep counting
across reconnects and the holder is backed off with growing intervals (``peers.peer_reads``).
Figures: per half of the capped window, requests, hit ratio and p50/p99 engine wait, the
requests that waited at least ``STALL_FRACTION`` of the deadline, the readers' fetch decisions
and the largest failure count their links to the holder showed.

``churn``: ``stay`` pods stay while the others are stopped and started ``rounds`` times
(``NetnsPool.stop_pod``/``start_pod``; a stopped pod leaves the pool name's answer, as an
endpoint of a headless Service does). Contract: after each round the survivors' links are
connected to live members only, none is left ``connected`` to a departed pod once the round's
pods are gone, and their descriptors (``/proc/<pid>/fd``) and RSS stay within
``FD_SLACK`` descriptors and ``RSS_SLACK_BYTES`` of round 1 (figures per round).

``reused_address``: a departed pod's address (and port) is taken by a sidecar of another pool
(another pool key and fingerprint) while the pool name still lists it (a stale answer).
Contract: the members' handshakes with it are refused as ``other_pool``, never ``bad_proof``
(``peers.handshake``: a peer that holds none of our keys is a stranger, not a forger), in a
bounded number (the links back off), and once the name stops listing it the link is gone.

``resolver_outage``: every pod's resolver fails (``NetnsPool.break_resolver``: the name gone
from its hosts file, its nameserver unreachable) for ``seconds``, then comes back. Contract:
discovery keeps its last answer (``peers.discovery``), so no link is torn down and every pod
still reads what another stores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from kv_offload_tools.bench.netns_load import PoolLoad
from kv_offload_tools.bench.netns_scenarios import STALL_FRACTION, summary
from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
from kv_offload_tools.netns.pool import NetnsPool

# A survivor's descriptors and RSS count as flat within these of round 1.
FD_SLACK = 16
RSS_SLACK_BYTES = 24 << 20
# Seconds between two polls of the sidecars' state.
POLL_SECONDS = 0.1


def capped_holder(pool: NetnsPool, holder: int, rate_bits: int, *, seconds: float,
                  **load: Any) -> dict[str, Any]:
    """Figures of pod ``holder`` serving its chunks through a ``rate_bits`` cap (module docstring)."""
    readers = [i for i in range(len(pool.sidecars)) if i != holder]
    identity = pool[holder].identity
    before = {r: _decisions(pool, r) for r in readers}
    failures: list[int] = []
    pool.net.cap_bandwidth(holder, rate_bits)
    try:
        with PoolLoad(pool, [holder], readers, tag=f"capped-{time.monotonic_ns()}", **load) as work:
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                failures.append(max((p["failures"] for r in readers for p in pool[r].peers()
                                     if p["identity"] == identity), default=0))
                time.sleep(POLL_SECONDS * 5)
            t_end = time.monotonic()
    finally:
        pool.net.uncap(holder)
    lag = load.get("lag_seconds", 1.0)
    requests = work.window(t0 + lag, t_end)
    middle = t0 + lag + (t_end - t0 - lag) / 2
    stall = STALL_FRACTION * pool.fetch_deadline_seconds
    halves = {"first_half": [r for r in requests if r.at < middle],
              "second_half": [r for r in requests if r.at >= middle]}
    figures: dict[str, Any] = {}
    for name, part in halves.items():
        figures[name] = {**summary(part), "stalled": sum(r.seconds >= stall for r in part)}
    after = {r: _decisions(pool, r) for r in readers}
    figures["decisions"] = {d: sum(after[r][d] - before[r][d] for r in readers) for d in ("fetch", "recompute")}
    figures["max_link_failures"] = max(failures, default=0)
    figures["rate_bits"] = rate_bits
    figures["errors"] = work.errors
    return figures


def _decisions(pool: NetnsPool, i: int) -> dict[str, float]:
    return {d: pool[i].metric("kv_offload_fetch_decisions_total", decision=d) for d in ("fetch", "recompute")}


def process_footprint(pid: int) -> tuple[int, int]:
    """(open descriptors, RSS bytes) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return fds, rss


def churn(pool: NetnsPool, stay: Sequence[int], rounds: int, *, timeout: float = 60.0) -> dict[str, Any]:
    """Figures of the pods outside ``stay`` stopped and started ``rounds`` times (module docstring)."""
    stay = list(stay)
    movers = [i for i in range(len(pool.sidecars)) if i not in stay]
    per_round: list[dict[str, Any]] = []
    for n in range(rounds):
        t0 = time.monotonic()
        for i in movers:
            pool.stop_pod(i)
        left_connected = _wait_links(pool, stay, live=set(stay), timeout=timeout)
        gone_s = round(time.monotonic() - t0, 2)
        footprint = {pool[i].identity: process_footprint(pool[i].proc.pid) for i in stay}  # type: ignore[union-attr]
        t1 = time.monotonic()
        for i in movers:
            pool.start_pod(i, wait=False)
        pool.wait_ready(timeout)
        pool.wait_connected(timeout)
        back_s = round(time.monotonic() - t1, 2)
        keys = chunk_keys(f"churn-{n}-{time.monotonic_ns()}", 4)
        shared = share_through_pool(pool, keys, pool.chunk_bytes, holder=movers[0], reader=stay[0])
        per_round.append({"round": n + 1, "departed_links_left": left_connected, "seconds_until_links_live": gone_s,
                          "seconds_until_rejoined": back_s, "shared": list(shared),
                          "fds": {k: v[0] for k, v in footprint.items()},
                          "rss_mib": {k: round(v[1] / 2**20, 1) for k, v in footprint.items()}})
    first = per_round[0]
    growth = {"fds": max(r["fds"][k] - first["fds"][k] for r in per_round for k in first["fds"]),
              "rss_mib": max(round(r["rss_mib"][k] - first["rss_mib"][k], 1) for r in per_round for k in first["rss_mib"])}
    return {"stay": [pool[i].identity for i in stay], "movers": len(movers), "rounds": per_round,
            "growth_over_round_1": growth}


def _wait_links(pool: NetnsPool, viewers: Sequence[int], *, live: set[int], timeout: float) -> int:
    """Until no viewer calls a pod outside ``live`` connected; how many such links were left then."""
    live_ids = {pool[i].identity for i in live}
    deadline = time.monotonic() + timeout

    def stale() -> int:
        return sum(1 for v in viewers for p in pool[v].peers()
                   if p["state"] == "connected" and p["identity"] not in live_ids)

    while (n := stale()) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    return n
