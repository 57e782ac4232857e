"""The scenarios of ``kv-offload bench netns``: a pod silently isolated then healed, and an
asymmetric partition. Each returns plain figures (a dict), measured on a started NetnsPool.

``isolate_and_heal``: every pod stores and reads (``netns_load.PoolLoad``); after
``before`` seconds the victim is cut from every other pod both ways (``PodNetwork.isolate``,
packets dropped without an answer), ``during`` seconds later the cut is healed, and the load
runs ``after`` seconds more. Figures: requests whose chunks the victim holds (and, apart, the
victim's own reads and everyone else's) per window: hit ratio, p50/p99 engine wait and what
the partition added to it; seconds from the cut until every other sidecar stopped calling the
victim connected (``/v1/peers``) and until the last request that waited on it (a request slower
than ``STALL_FRACTION`` of the fetch deadline began); seconds from the heal until they call it
connected again and until a request for the victim's chunks hit whole; TCP connections between
pods left without their other end (``probes.half_open``) at the end of the cut, once
reconnected and at the end.

``isolate_idle``: the same cut with no traffic to the victim: whether (and when) the other
sidecars stop calling it connected within ``seconds``, and how long one engine lookup of a
chunk it holds waits once that time is over.

``asymmetric``: one pod (``a``) cannot reach another's (``b``) control port, ``b`` reaches
``a``; a third (``c``) stores, every other pod reads: per reader, the hit share of ``c``'s
chunks before and during the partition, what each pod's sidecar calls the others, and the
peers each counts as reaching it but unreachable (``kv_offload_peers_unreachable``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv_offload_tools.bench.netns.load import PoolLoad, Request
from kv_offload_tools.bench.quantile import quantile
from kv_offload_tools.chaos.chunks import chunk_keys, store_chunks
from kv_offload_tools.netns.pool import NetnsPool
from kv_offload_tools.netns.probes import half_open

# A request waited on the cut-off pod when it took more than this share of the fetch deadline.
STALL_FRACTION = 0.5
# Seconds between two polls of the sidecars' /v1/peers.
POLL_SECONDS = 0.1


def summary(requests: Sequence[Request]) -> dict[str, Any]:
    """Count, hit ratio, wrong chunks and p50/p99 engine wait (ms) of ``requests``."""
    asked = sum(r.asked for r in requests)
    waits = [r.seconds for r in requests]
    ms = lambda v: None if v is None else round(1e3 * v, 1)  # noqa: E731
    return {"requests": len(requests),
            "hit_ratio": round(sum(r.loaded for r in requests) / asked, 3) if asked else None,
            "wrong": sum(r.wrong for r in requests),
            "p50_ms": ms(quantile(waits, 0.5)), "p99_ms": ms(quantile(waits, 0.99))}


def added(during: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """p50/p99 of ``during`` minus ``before`` (ms)."""
    return {k: None if during[k] is None or before[k] is None else round(during[k] - before[k], 1)
            for k in ("p50_ms", "p99_ms")}


class PeerWatch:
    """Polls ``/v1/peers`` of some sidecars in a thread: when each called a given identity connected."""

    def __init__(self, pool: NetnsPool, watchers: Sequence[int], identity: str) -> None:
        self.pool, self.watchers, self.identity = pool, tuple(watchers), identity
        # (time.monotonic(), {watcher: True when it calls ``identity`` connected}).
        self.samples: list[tuple[float, dict[int, bool]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvn-peer-watch", daemon=True)

    def __enter__(self) -> "PeerWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _connected(self, watcher: int) -> bool:
        try:
            return any(p["identity"] == self.identity and p["state"] == "connected"
                       for p in self.pool[watcher].peers())
        except (OSError, KeyError, TypeError):
            return False

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.samples.append((time.monotonic(), {w: self._connected(w) for w in self.watchers}))

    def first(self, since: float, test: Callable[[dict[int, bool]], bool]) -> float | None:
        """Seconds from ``since`` to the first sample after it that passes ``test``."""
        return next((round(t - since, 2) for t, s in list(self.samples) if t >= since and test(s)), None)


def isolate_and_heal(pool: NetnsPool, victim: int, *, before: float, during: float, after: float,
                     **load: Any) -> dict[str, Any]:
    """Figures of one silent isolation of pod ``victim`` and its heal (module docstring)."""
    others = [i for i in range(len(pool.sidecars)) if i != victim]
    every = range(len(pool.sidecars))
    stall = STALL_FRACTION * pool.fetch_deadline_seconds
    half: dict[str, int] = {}
    with PoolLoad(pool, every, every, tag=f"isolate-{time.monotonic_ns()}", **load) as work, \
            PeerWatch(pool, others, pool[victim].identity) as watch:
        t0 = time.monotonic()
        time.sleep(before)
        t_cut = time.monotonic()
        pool.net.isolate(victim)
        time.sleep(during)
        half["end_of_cut"] = len(half_open(pool.net))
        t_heal = time.monotonic()
        pool.net.heal()
        reconnected = _until(lambda: watch.samples and watch.samples[-1][0] > t_heal
                             and all(watch.samples[-1][1].values()), after)
        if reconnected:
            half["reconnected"] = len(half_open(pool.net))
        time.sleep(max(0.0, t_heal + after - time.monotonic()))
        half["end"] = len(half_open(pool.net))
        t_end = time.monotonic()
    requests = work.window(t0 + load.get("lag_seconds", 1.0), t_end)

    def part(pick: Callable[[Request], bool], t1: float, t2: float) -> dict[str, Any]:
        return summary([r for r in requests if pick(r) and t1 <= r.at < t2])

    held = lambda r: r.holder == victim and r.reader != victim  # noqa: E731
    own = lambda r: r.reader == victim  # noqa: E731
    rest = lambda r: victim not in (r.holder, r.reader)  # noqa: E731
    windows = {"before": (t0, t_cut), "during": (t_cut, t_heal), "after": (t_heal, t_end)}
    figures: dict[str, Any] = {
        kind: {w: part(pick, *span) for w, span in windows.items()}
        for kind, pick in (("victims_chunks", held), ("victims_reads", own), ("others", rest))}
    for kind in ("victims_chunks", "others"):
        figures[kind]["added"] = added(figures[kind]["during"], figures[kind]["before"])
    stalled = [r for r in requests if held(r) and t_cut <= r.at < t_heal and r.seconds > stall]
    first_hit = min((r.at + r.seconds for r in requests
                     if held(r) and r.at >= t_heal and r.asked and r.loaded == r.asked), default=None)
    figures["timeline_s"] = {
        "cut_to_all_drop_it": watch.first(t_cut, lambda s: not any(s.values())),
        "cut_to_last_stalled_request": round(max(r.at for r in stalled) - t_cut, 2) if stalled else None,
        "stalled_requests": len(stalled),
        "heal_to_all_connected": watch.first(t_heal, lambda s: all(s.values())),
        "heal_to_first_whole_hit": None if first_hit is None else round(first_hit - t_heal, 2),
    }
    figures["half_open"] = half
    figures["errors"] = work.errors
    return figures


def isolate_idle(pool: NetnsPool, victim: int, reader: int, *, seconds: float) -> dict[str, Any]:
    """Figures of a silent isolation of ``victim`` while nothing asks it (module docstring)."""
    others = [i for i in range(len(pool.sidecars)) if i != victim]
    keys = chunk_keys(f"idle-{time.monotonic_ns()}", 4)
    with pool.client(victim) as holder:
        store_chunks(holder, keys, pool.chunk_bytes)
    known = _until(lambda: pool[reader].hits(keys) == len(keys), 10.0)  # the directory learnt them
    with PeerWatch(pool, others, pool[victim].identity) as watch:
        t_cut = time.monotonic()
        pool.net.isolate(victim)
        try:
            _until(lambda: watch.samples and watch.samples[-1][0] > t_cut
                   and not any(watch.samples[-1][1].values()), seconds)
            still = sum(watch.samples[-1][1].values()) if watch.samples else None
            with pool.client(reader) as engine:
                t0 = time.monotonic()
                hit = engine.lookup(keys, pool.fetch_deadline_seconds + 1).hits
                lookup_ms = round(1e3 * (time.monotonic() - t0), 1)
        finally:
            pool.net.heal()
    return {"seconds": seconds, "known_before_cut": known,
            "cut_to_all_drop_it": watch.first(t_cut, lambda s: not any(s.values())),
            "still_connected_to_it": still, "lookup_after_ms": lookup_ms, "lookup_hits": hit}


def asymmetric(pool: NetnsPool, a: int, b: int, c: int, *, before: float, during: float,
               **load: Any) -> dict[str, Any]:
    """Figures of ``a`` cut from ``b``'s control port (``b`` still reaches ``a``) while ``c`` stores."""
    readers = [i for i in range(len(pool.sidecars)) if i != c]
    with PoolLoad(pool, [c], readers, tag=f"asym-{time.monotonic_ns()}", **load) as work:
        t0 = time.monotonic()
        time.sleep(before)
        t_cut = time.monotonic()
        pool.net.partition(a, b, port=pool.base_port)
        try:
            time.sleep(during)
            views = {pool[i].identity: sorted(p["identity"] for p in pool[i].peers()
                                              if p["state"] == "connected") for i in range(len(pool.sidecars))}
            members = {pool[i].identity: pool[i].status()["location"]["members"]
                       for i in range(len(pool.sidecars))}
            unreachable = {pool[i].identity: _gauge(pool[i].metrics_text(), "kv_offload_peers_unreachable")
                           for i in range(len(pool.sidecars))}
        finally:
            t_end = time.monotonic()
            pool.net.heal()
    requests = work.window(t0 + load.get("lag_seconds", 1.0), t_end)
    per_pod = {pool[r].identity: {
        "before": summary([q for q in requests if q.reader == r and q.at < t_cut]),
        "during": summary([q for q in requests if q.reader == r and q.at >= t_cut])} for r in readers}
    return {"a": pool[a].identity, "b": pool[b].identity, "c": pool[c].identity, "readers": per_pod,
            "connected_views": views, "members_seen": members, "unreachable_peers": unreachable,
            "errors": work.errors}


def _gauge(metrics_text: str, name: str) -> float | None:
    """The value of an unlabelled metric in a /metrics text."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _until(probe: Callable[[], object], timeout: float) -> bool:
    """Whether ``probe()`` became truthy within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(POLL_SECONDS)
    return bool(probe())
