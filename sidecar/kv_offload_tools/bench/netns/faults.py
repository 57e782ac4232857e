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
from collections.abc import Callable, Sequence
from typing import Any

from kv_offload_tools.bench.netns.load import PoolLoad
from kv_offload_tools.bench.netns.scenarios import STALL_FRACTION, summary
from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
from kv_offload_testing.local_pool import SidecarOverride, example_config
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
    live_addresses = {pool[i].address for i in stay}
    per_round: list[dict[str, Any]] = []
    for n in range(rounds):
        t0 = time.monotonic()
        for i in movers:  # all at once, as a scale-down does
            pool[i].sigterm()
        for i in movers:
            pool.stop_pod(i)
        left_connected = _wait_links(pool, stay, live=set(stay), timeout=timeout)
        gone_s = round(time.monotonic() - t0, 2)
        forgotten = _until(lambda: all({p["address"] for p in pool[v].peers()} <= live_addresses for v in stay),
                           timeout)
        forgotten_s = round(time.monotonic() - t0, 2) if forgotten else None
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
                          "seconds_until_departed_forgotten": forgotten_s,
                          "seconds_until_rejoined": back_s, "shared": list(shared),
                          "fds": {k: v[0] for k, v in footprint.items()},
                          "rss_mib": {k: round(v[1] / 2**20, 1) for k, v in footprint.items()}})
    first = per_round[0]
    growth = {"fds": max(r["fds"][k] - first["fds"][k] for r in per_round for k in first["fds"]),
              "rss_mib": max(round(r["rss_mib"][k] - first["rss_mib"][k], 1)
                             for r in per_round for k in first["rss_mib"])}
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


def _until(probe: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


HANDSHAKES = "kv_offload_handshakes_total"
# Reasons a refusal may carry here (handshake.REASONS with the alerting one first).
REFUSALS = ("bad_proof", "other_pool")


def _refusals(pool: NetnsPool, i: int) -> dict[str, float]:
    return {r: pool[i].metric(HANDSHAKES, result="rejected", reason=r) for r in REFUSALS}


def reused_address(pool: NetnsPool, departed: int, *, stale_seconds: float,
                   timeout: float = 60.0) -> dict[str, Any]:
    """Figures of a departed pod's address taken by a sidecar of another pool (module docstring)."""
    members = [i for i in range(len(pool.sidecars)) if i != departed]
    address = pool[departed].address
    before = {i: _refusals(pool, i) for i in members}
    pool.stop_pod(departed)
    pool.net.list_pod(pool.pod(departed))  # the name's answer still lists it (stale)
    other = pool.start_pod(departed, SidecarOverride(config=example_config(tokens_per_hash=32),
                                                     pool_key=b"another pool's key, not ours"))
    t0 = time.monotonic()
    refused = _until(lambda: all(_refusals(pool, i)["other_pool"] > before[i]["other_pool"] for i in members),
                     timeout)
    time.sleep(max(0.0, t0 + stale_seconds - time.monotonic()))  # the stale answer lasts this long
    during = {i: _refusals(pool, i) for i in members}
    states = sorted({p["state"] for i in members for p in pool[i].peers() if p["address"] == address})
    t_unlisted = time.monotonic()
    pool.net.list_pod(pool.pod(departed), False)  # the endpoint goes
    forgotten = _until(lambda: all(p["address"] != address for i in members for p in pool[i].peers()), timeout)
    after = {i: _refusals(pool, i) for i in members}
    return {"address": address, "stale_seconds": stale_seconds, "refused_by_all": refused,
            "member_refusals": {pool[i].identity: {r: after[i][r] - before[i][r] for r in REFUSALS}
                                for i in members},
            "member_refusals_while_listed": {pool[i].identity: during[i]["other_pool"] - before[i]["other_pool"]
                                             for i in members},
            "link_states_while_listed": states,
            "other_pool_sidecar_refusals": _refusals(pool, departed),
            "seconds_from_unlisted_to_forgotten": round(time.monotonic() - t_unlisted, 2) if forgotten else None,
            "other": other.identity}


def resolver_outage(pool: NetnsPool, *, seconds: float, timeout: float = 60.0) -> dict[str, Any]:
    """Figures of every pod's resolver failing for ``seconds`` (module docstring)."""
    every = range(len(pool.sidecars))
    logged = {i: os.path.getsize(pool[i].log_path) for i in every}
    connected = {i: _connected(pool, i) for i in every}
    pool.net.break_resolver()
    t0 = time.monotonic()
    try:
        failed = _until(lambda: all(_logged_since(pool, i, logged[i], "resolving peers DNS name") for i in every),
                        timeout)
        failed_s = round(time.monotonic() - t0, 2)
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        during = {i: _connected(pool, i) for i in every}
        keys = chunk_keys(f"resolver-out-{time.monotonic_ns()}", 4)
        shared = share_through_pool(pool, keys, pool.chunk_bytes, holder=0, reader=len(pool.sidecars) - 1)
    finally:
        pool.net.restore_resolver()
    return {"seconds": seconds, "every_pod_failed_to_resolve": failed, "seconds_until_all_failed": failed_s,
            "connected_before": sum(map(len, connected.values())), "connected_during": sum(map(len, during.values())),
            "links_lost": sum(len(connected[i] - during[i]) for i in every), "shared_during": list(shared)}


def _connected(pool: NetnsPool, i: int) -> set[str]:
    return {p["identity"] for p in pool[i].peers() if p["state"] == "connected"}


def _logged_since(pool: NetnsPool, i: int, offset: int, text: str) -> bool:
    with open(pool[i].log_path, "rb") as fh:
        fh.seek(offset)
        return text.encode() in fh.read()
