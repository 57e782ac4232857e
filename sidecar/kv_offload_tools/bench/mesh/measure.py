"""What ``kv-offload bench mesh`` reads from its real sidecars: /proc, /v1/status, /v1/peers, /metrics.

``snapshot`` reads every sidecar's process first (``/proc/PID/fd``, ``/proc/PID/status``:
descriptors, sockets among them, threads, VmRSS, RssAnon), then asks each its control API
(so this bench's own HTTP requests are not among the descriptors counted): peers whose
session is connected, peers with open data lanes (``/v1/status`` ``data_lanes``), inbound
sessions, directory members. ``MassJoin`` is a LocalPool whose start is timed: every
process launched at once, then each stand-in engine states its identity through the
sidecar's local socket (as vLLM does from inside its pod: on this host every sidecar and
this bench share 127.0.0.1, so a probe over TCP is one more stranger from the peers'
address, refused at the door while the peers' handshakes hold that address's 16 unproven
places, and the sidecars still waiting for it answer those handshakes 503: LocalPool's
one-at-a-time readiness never got past 19 of 32), then ready (``/readyz``), then
settled (``settled``: every sidecar's directory counts every member and none has a peer
still connecting; the state sidecars expose both with a full mesh and with links opened on
demand). ``share`` is the short workload: writers store chunks, readers load them through
the pool, every byte checked.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.sidecar import store_name

from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_testing.local_pool import LocalPool
from kv_offload_testing.scrape import parse_metrics, value
from kv_offload_testing.sidecar_process import SidecarProcess

# Seconds between two polls of the pool's state.
POLL_SECONDS = 0.25
# Fields of /proc/PID/status read per sidecar (kB values become bytes), by the name reported.
_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "Threads": "threads"}


def proc_figures(pid: int) -> dict[str, int]:
    """Descriptors, sockets among them, threads, RSS and anonymous RSS of process ``pid``."""
    fd_dir = f"/proc/{pid}/fd"
    names = os.listdir(fd_dir)
    sockets = 0
    for name in names:
        with contextlib.suppress(OSError):  # closed meanwhile
            sockets += os.readlink(os.path.join(fd_dir, name)).startswith("socket:")
    out = {"fds": len(names), "sockets": sockets}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in _STATUS_FIELDS:
                number = int(rest.split()[0])
                out[_STATUS_FIELDS[key]] = number if key == "Threads" else number * 1024
    return out


def api_figures(sc: SidecarProcess) -> dict[str, int]:
    """What one sidecar says of its links: connected sessions, peers with data lanes, members."""
    status = sc.status()
    lanes = {p: int(n) for p, n in (status.get("data_lanes") or {}).items() if int(n) > 0}
    peers = sc.peers()
    return {"connected_peers": sum(p["state"] == "connected" for p in peers),
            "known_peers": len(peers),
            "data_linked_peers": len(lanes), "data_lanes": sum(lanes.values()),
            "inbound_sessions": int(status.get("inbound_sessions", 0)),
            "members": int(status["location"]["members"])}


def snapshot(pool: LocalPool) -> list[dict[str, Any]]:
    """Per sidecar: /proc figures (all read before any HTTP request), then its API's."""
    rows = [{"identity": sc.identity, **proc_figures(sc.proc.pid)} for sc in pool.sidecars]  # type: ignore[union-attr]
    for row, sc in zip(rows, pool.sidecars):
        row.update(api_figures(sc))
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, min and max over the sidecars of every numeric field of a snapshot."""
    fields = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
    return {k: {"mean": sum(r[k] for r in rows) / len(rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in fields}


def handshakes(pool: LocalPool) -> dict[str, float]:
    """Handshakes the sidecars counted (each end counts one it made or answered), by result;
    connections and handshakes refused at the door (``too_many_connections``, ``rate_limited``:
    on this host every peer comes from 127.0.0.1); dial failures their links count
    (``/v1/peers`` ``failures``); summed over the pool."""
    out = dict.fromkeys(("accepted", "rejected", "too_many_connections", "rate_limited", "dial_failures"), 0.0)
    for sc in pool.sidecars:
        samples = parse_metrics(sc.metrics_text())
        for result in ("accepted", "rejected"):
            out[result] += value(samples, "kv_offload_handshakes_total", result=result)
        for reason in ("too_many_connections", "rate_limited"):
            out[reason] += value(samples, "kv_offload_protocol_errors_total", reason=reason)
        out["dial_failures"] += sum(int(p.get("failures", 0)) for p in sc.peers())
    return out


def unsettled(pool: LocalPool) -> list[str]:
    """What keeps the pool from being settled: sidecars whose directory lacks members, or
    with a peer still connecting."""
    n = len(pool.sidecars)
    lacking = []
    for sc in pool.sidecars:
        try:
            status = sc.status(timeout=10.0)
        except (OSError, RuntimeError) as exc:
            lacking.append(f"{sc.identity}: {exc}")
            continue
        members = int(status["location"]["members"])
        connecting = int((status.get("peers") or {}).get("connecting", 0))
        if members != n or connecting:
            lacking.append(f"{sc.identity} counts {members} of {n} members, {connecting} peers connecting")
    return lacking


def wait_settled(pool: LocalPool, timeout: float) -> None:
    """Until ``unsettled`` names nothing; TimeoutError naming what it still named."""
    deadline = time.monotonic() + timeout
    while lacking := unsettled(pool):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the mesh did not settle in {timeout:g} s: " + "; ".join(lacking[:4])
                               + (f" (and {len(lacking) - 4} more)" if len(lacking) > 4 else ""))
        time.sleep(POLL_SECONDS)


class MassJoin(LocalPool):
    """A LocalPool whose ``start`` launches every sidecar at once and records when all were
    ready and when the mesh settled (``settled``, not a full mesh of connected sessions)."""

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        # time.monotonic() when start() began, every engine had stated its identity, all
        # sidecars were ready, the mesh settled.
        self.started_at = 0.0
        self.stated_at = 0.0
        self.ready_at = 0.0
        self.settled_at = 0.0

    def start(self, timeout: float = 60.0) -> MassJoin:
        self.started_at = time.monotonic()
        super().start(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(self.sidecars)
        while waiting:
            for sc in list(waiting):
                if not sc.alive():
                    raise RuntimeError(f"{sc.identity} exited with code {sc.proc.returncode}:\n{sc.log_tail()}")  # type: ignore[union-attr]
                if self._state_identity(sc):
                    waiting.remove(sc)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} engines could not state their identity in {timeout:g} s, "
                                   f"e.g. {waiting[0].identity}:\n{waiting[0].log_tail()}")
            time.sleep(POLL_SECONDS if waiting else 0)
        self.stated_at = time.monotonic()
        super().wait_ready(max(1.0, deadline - time.monotonic()))
        self.ready_at = time.monotonic()

    def _state_identity(self, sc: SidecarProcess) -> bool:
        """Whether a stand-in engine stated its identity through ``sc``'s local socket just now."""
        path = os.path.join(self.workdir, f"kv-offload-{store_name(sc.identity)}-dp{sc.dp_indices[0]}.sock")
        if sc.model_identity is None or not os.path.exists(path):
            return sc.model_identity is None
        try:
            EngineClient(path, timeout=5.0, states=sc.model_identity.statement()).close()
        except (OSError, ValueError):  # not listening yet (SidecarUnavailable is a ConnectionError)
            return False
        return True

    def wait_connected(self, timeout: float = 60.0) -> None:
        wait_settled(self, max(1.0, timeout - (time.monotonic() - self.started_at)))
        self.settled_at = time.monotonic()


def share(pool: LocalPool, writers: Sequence[int], readers: Sequence[int], chunks: int,
          tag: str, timeout: float = 60.0) -> dict[str, Any]:
    """Each writer stores ``chunks`` fresh chunks; once a reader's admin lookup finds all of a
    writer's, it loads them through its engine, every byte checked."""
    started = time.monotonic()
    nbytes = pool.chunk_bytes
    batches = {w: chunk_keys(f"{tag}/{w}", chunks) for w in writers}
    stored = 0
    for w, keys in batches.items():
        with pool.client(w) as engine:
            stored += store_chunks(engine, keys, nbytes)
    loaded = wrong = 0
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    for r in readers:
        with pool.client(r) as engine:
            for w, keys in batches.items():
                while pool[r].hits(keys) < len(keys) and time.monotonic() < deadline:
                    time.sleep(POLL_SECONDS)
                got, bad = load_and_verify(engine, keys, nbytes)
                loaded, wrong = loaded + got, wrong + bad
                if got < len(keys):
                    errors.append(f"{pool[r].identity} loaded {got} of {pool[w].identity}'s {len(keys)} chunks")
    return {"writers": [pool[w].identity for w in writers], "readers": [pool[r].identity for r in readers],
            "stored": stored, "expected_stored": len(writers) * chunks, "loaded": loaded,
            "expected_loaded": len(readers) * len(writers) * chunks, "wrong": wrong, "errors": errors,
            "seconds": time.monotonic() - started}
