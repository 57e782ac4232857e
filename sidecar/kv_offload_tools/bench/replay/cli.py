"""`kv-offload bench replay`: hit ratios of real sidecars replaying a Mooncake trace.

Each trace line is one request: ``hash_ids`` name its prompt blocks in prefix
order (equal ids at equal positions mean equal prefixes), one chunk each. The
bench turns every request into vLLM-style chunk keys (the prefix hash chain
over the ids), routes it to one of N replicas and does what the vLLM tier
does against that replica's real sidecar process: ``lookup`` the keys,
``load`` the hit prefix (the sidecar fetches from peers what it lacks), verify
the bytes, ``store`` the rest. A request's hits are the longest prefix loaded.

From one invocation it reports:
- ``p2p_hit_ratio``: the N sidecars sharing chunks (measured);
- ``local_only_hit_ratio``: the same sidecars without peers (measured, second run);
- ``pooled_lru_hit_ratio``: one LRU cache of N x capacity chunks (simulated);
- ``ideal_hit_ratio``: infinite capacity (simulated);
- ``lookup_messages_per_request``: peer messages the sidecars sent to answer
  engine lookups and loads (``kv_offload_lookup_messages_total``) per request:
  ``owner_queries_per_request`` (a question to the chunk directory's owner of the
  first missing key, asked by every request that lacks a chunk, unless the
  sidecar owns it) plus holder exchanges (``holder_exchanges_per_peer_hit_request``:
  one lookup-and-fetch with the holder named, per request that got peer hits);
- ``bytes_moved``: chunk bytes received from peers (``kv_offload_peer_bytes_total``),
  and ``bytes_moved_per_hit``;
- ``prefill``: prefill time saved under a stated engine and link model, with every peer
  run fetched and with the sidecar's fetch-or-recompute decision (``prefill_model``);
- with ``--routing prefix-hint``: ``hinted_requests`` and ``hint_messages_per_request``.
It also writes a PNG: hit ratio against capacity (simulated curves and the
measured points) and, with ``--sweep-replicas``, against the number of replicas.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.settings import DEFAULT_HASH_SEED, PEER_COPIES, TRANSPORTS
from kv_offload_sidecar.usage import UsageError

from kv_offload_testing import scrape
from kv_offload_tools.bench.replay.prefill_model import PrefillSettings, format_rows, prefill_savings
from kv_offload_testing.local_pool import LocalPool, example_config
from kv_offload_tools.mooncake_trace import TraceRequest, load_requests, write_requests
from kv_offload_testing.prefix_hash import make_offload_key, none_hash, sha256
from kv_offload_tools.progress import to_stderr
from kv_offload_tools.workloads import WORKLOADS, ConversationSpec, conversation

ROUTINGS = ("round-robin", "random", "prefix-aware", "session-affine", "prefix-hint")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ReplaySettings:
    # Mooncake-format JSONL trace ("" when the requests are generated).
    trace: str
    # Number of vLLM replicas (one sidecar each).
    replicas: int
    # Chunk slots of each replica's sidecar store.
    capacity_chunks: int
    # Bytes of one chunk (the sidecars' kv_bytes_per_chunk).
    chunk_bytes: int
    # How requests are spread over replicas: round-robin, random, prefix-aware (simulated
    # knowledge), session-affine, or prefix-hint (the sidecars' POST /v1/route, asked per request).
    routing: str = "round-robin"
    # Replay only the first N requests of the trace (None: all).
    limit: int | None = None
    # Data plane between sidecars: tcp or ucx.
    transport: str = "tcp"
    # Seconds between the sidecars' publishes to the chunk directory (staleness of peer locations).
    publish_interval_seconds: float = 0.05
    # Deadline of one lookup or load (seconds); late means a miss.
    timeout_seconds: float = 2.0
    # Seed of the random routing (and of a generated workload).
    seed: int = 0
    # Generated workload instead of a trace: "conversation" (workloads.py), or None.
    generate: str | None = None
    # Sessions and turns per session of a generated conversation workload.
    sessions: int = 200
    turns: int = 6
    # Mean seconds a user thinks between turns (longer: more sessions open at once).
    think_seconds: float = 20.0
    # The sidecars' sharing policy for chunks fetched from peers: "drop" or "cold" (--peer-copies).
    peer_copies: str = "drop"
    # The engine and links the prefill time saved is priced with.
    prefill: PrefillSettings = field(default_factory=PrefillSettings)


@dataclass
class RunResult:
    """One real replay over N sidecars."""

    # Chunks asked; of those, loaded from the replica's own sidecar and loaded from a peer.
    total_chunks: int = 0
    local_hits: int = 0
    peer_hits: int = 0
    # Requests that loaded at least one chunk from a peer.
    peer_hit_requests: int = 0
    mismatched_chunks: int = 0
    lookup_messages: float = 0.0
    # Of those, questions to directory owners (kv_offload_location_messages_total{kind="locate"}).
    owner_queries: float = 0.0
    bytes_moved: float = 0.0
    seconds: float = 0.0
    # Per request: (chunks held locally and loaded, chunks loaded from peers, chunks asked).
    outcomes: list[tuple[int, int, int]] = field(default_factory=list)
    # The replica each request went to (prefix-hint routing decides while replaying).
    routes: list[int] = field(default_factory=list)
    # Requests sent to a pod the routing hint named.
    hinted: int = 0
    # Messages between sidecars to answer routing hints (owner questions and holder counts).
    hint_messages: float = 0.0

    @property
    def hit_chunks(self) -> int:
        return self.local_hits + self.peer_hits

    @property
    def hit_ratio(self) -> float:
        return self.hit_chunks / self.total_chunks if self.total_chunks else 0.0


@dataclass
class ReplayReport:
    replicas: int
    capacity_chunks: int
    chunk_bytes: int
    routing: str
    requests: int
    chunks: int
    p2p_hit_ratio: float
    local_only_hit_ratio: float
    pooled_lru_hit_ratio: float
    ideal_hit_ratio: float
    lookup_messages_per_request: float
    lookup_messages_per_peer_hit_request: float
    bytes_moved: int
    p2p_local_hits: int
    p2p_peer_hits: int
    mismatched_chunks: int
    seconds: float
    plot: str | None = None
    sweep: list[dict] = field(default_factory=list)
    # What was replayed: "trace <path>" or "conversation <sessions>x<turns>".
    workload: str = ""
    # Questions to the chunk directory's owners per request.
    owner_queries_per_request: float = 0.0
    # Exchanges with holders (lookup messages besides owner questions) per peer-hit request.
    holder_exchanges_per_peer_hit_request: float = 0.0
    # The sidecars' sharing policy ("drop" or "cold").
    peer_copies: str = "drop"
    # Chunk bytes received from peers per chunk hit.
    bytes_moved_per_hit: float = 0.0
    # Prefill time saved per modelled link (prefill_model.prefill_savings).
    prefill: list[dict] = field(default_factory=list)
    # Requests a routing hint placed (prefix-hint routing).
    hinted_requests: int = 0
    # Messages between sidecars per routing hint (prefix-hint routing; a gateway's one call not counted).
    hint_messages_per_request: float = 0.0


# ---- trace and keys -------------------------------------------------------------

def request_keys(trace: Sequence[Sequence[int]], seed: str = DEFAULT_HASH_SEED) -> list[list[bytes]]:
    """vLLM-style chunk keys: the prefix hash chain over the hash ids, group 0."""
    root = none_hash(sha256, seed)
    memo: dict[tuple[bytes, int], bytes] = {}
    out = []
    for ids in trace:
        parent, keys = root, []
        for h in ids:
            link = memo.get((parent, h))
            if link is None:
                link = memo[(parent, h)] = sha256((parent, (h,), None))
            parent = link
            keys.append(make_offload_key(link, 0))
        out.append(keys)
    return out


def route(trace: Sequence[Sequence[int]], replicas: int, routing: str, seed: int = 0,
          sessions: Sequence[int | None] = ()) -> list[int]:
    """Replica of every request. prefix-aware sends a request where its longest known
    prefix went (round-robin for new prefixes); session-affine sends every turn of a
    conversation to the replica of its session (``sessions``, one per request)."""
    if routing == "session-affine":
        if len(sessions) != len(trace) or any(s is None for s in sessions):
            raise ValueError("--routing session-affine needs a session_id on every request: "
                             "use --generate conversation or a trace with session_id, or another routing")
        return [int(s) % replicas for s in sessions]  # type: ignore[arg-type]
    if routing == "round-robin":
        return [i % replicas for i in range(len(trace))]
    if routing == "random":
        rng = random.Random(seed)
        return [rng.randrange(replicas) for _ in trace]
    if routing == "prefix-aware":
        owner: dict[tuple[int, int], int] = {}
        out, rr = [], 0
        for ids in trace:
            pick = None
            for pos in range(len(ids) - 1, -1, -1):
                pick = owner.get((pos, ids[pos]))
                if pick is not None:
                    break
            if pick is None:
                pick, rr = rr % replicas, rr + 1
            for pos, h in enumerate(ids):
                owner[(pos, h)] = pick
            out.append(pick)
        return out
    if routing == "prefix-hint":
        raise ValueError("prefix-hint routing is decided while replaying, from the sidecars' hints")
    raise ValueError(f"routing {routing!r} is not one of {list(ROUTINGS)}")


# ---- simulated caches -------------------------------------------------------------

def simulate_lru(keys: Sequence[Sequence[bytes]], routes: Sequence[int], caches: int,
                 capacity: float) -> float:
    """Hit ratio of ``caches`` LRU caches of ``capacity`` chunks each (prefix hits;
    a hit prefix is touched, the rest inserted). ``capacity`` may be math.inf."""
    stores: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(caches)]
    hits = total = 0
    for req, c in zip(keys, routes):
        store = stores[c]
        n = 0
        while n < len(req) and req[n] in store:
            n += 1
        for k in reversed(req[:n]):
            store.move_to_end(k)
        for k in req[n:]:
            store[k] = None
            if len(store) > capacity:
                store.popitem(last=False)
        hits += n
        total += len(req)
    return hits / total if total else 0.0


# ---- real replay ------------------------------------------------------------------

def _payload(key: bytes, size: int) -> bytes:
    reps = -(-size // len(key))
    return (key * reps)[:size]


@dataclass(frozen=True)
class RequestOutcome:
    """What one request did against its replica's sidecar."""

    # The engine lookup's answer: leading keys held locally, then by peers.
    local: int
    peer: int
    # Leading keys loaded (the request's hits).
    loaded: int
    # Loaded chunks whose bytes differed from the key's payload (must be 0).
    mismatched: int


def serve_request(client, req: Sequence[bytes], chunk_bytes: int, timeout: float) -> RequestOutcome:
    """What the vLLM tier does for one request: lookup, load the hits (verified byte for byte),
    store the rest."""
    reply = client.lookup(req, timeout=timeout)
    loaded, bad = 0, [0]
    if reply.hits:
        def check(i: int, view: memoryview) -> None:
            if view.tobytes() != _payload(req[i], chunk_bytes):
                bad[0] += 1

        loaded = client.load(req[:reply.hits], check, timeout=timeout)

    def fill(i: int, view: memoryview, todo=req[loaded:]) -> None:
        view[:] = _payload(todo[i], chunk_bytes)

    client.store(req[loaded:], fill)
    return RequestOutcome(reply.local, reply.peer, loaded, bad[0])


def sidecar_config(chunk_bytes: int):
    """One 512-token block per chunk (Mooncake's block), chunk_bytes of KV each."""
    return example_config(tokens_per_block=512, tokens_per_hash=512, blocks_per_chunk=1,
                          num_layers=1, worker_kv_bytes_per_block=chunk_bytes,
                          engine_id="kv-offload-replay")


class PrefixHintPicker:
    """A gateway's endpoint picker fed by the sidecars' routing hints (``POST /v1/route``).

    For each request it asks one sidecar (the next in turn, as a gateway may ask any pod)
    which pods hold the longest prefix of the request's chunk keys, and sends the request to
    the first of them that is not overloaded: fewer than ``slack`` x its fair share of the
    last ``window`` requests (load scorers in the Gateway API Inference Extension play the
    same part). With no such pod, the least loaded one, in turn.
    """

    def __init__(self, sidecars: Sequence, timeout: float, *, window_per_replica: int = 4,
                 slack: float = 1.5) -> None:
        self._sidecars = list(sidecars)
        self._index = {sc.identity: i for i, sc in enumerate(self._sidecars)}
        self._timeout = timeout
        self._slack = slack
        self._recent: deque[int] = deque(maxlen=window_per_replica * len(self._sidecars))
        self._load = [0] * len(self._sidecars)
        self._turn = 0
        # Requests sent to a pod the hint named.
        self.hinted = 0

    def pick(self, req: Sequence[bytes]) -> int:
        n = len(self._sidecars)
        asked = self._sidecars[self._turn % n]
        code, body = asked.post("/v1/route", {"keys": [k.hex() for k in req]}, timeout=self._timeout)
        if code != 200:
            raise RuntimeError(f"{asked.identity}: POST /v1/route answered {code}: {body!r}")
        limit = self._slack * len(self._recent) / n + 1
        choice = next((i for i in (self._index.get(p["pod"]) for p in body["pods"])
                       if i is not None and self._load[i] < limit), None)
        if choice is None:
            choice = min(range(n), key=lambda i: (self._load[i], (i - self._turn) % n))
        else:
            self.hinted += 1
        self._turn += 1
        if len(self._recent) == self._recent.maxlen:
            self._load[self._recent[0]] -= 1
        self._recent.append(choice)
        self._load[choice] += 1
        return choice


def replay_real(settings: ReplaySettings, keys: Sequence[Sequence[bytes]], routes: Sequence[int] | None,
                replicas: int, sharing: bool, progress: Progress | None = None) -> RunResult:
    """Replay against real sidecars: one pool of ``replicas`` (sharing) or isolated ones.
    ``routes`` None: each request goes where the sidecars' routing hints say (prefix-hint)."""
    config = sidecar_config(settings.chunk_bytes)
    common = dict(transport=settings.transport, config=config,
                  capacity_bytes=settings.capacity_chunks * slot_stride_for(settings.chunk_bytes),
                  publish_interval_seconds=settings.publish_interval_seconds,
                  fetch_deadline_seconds=settings.timeout_seconds, log_level="WARNING",
                  extra_args=("--peer-copies", settings.peer_copies))
    pools = [LocalPool(replicas, **common)] if sharing else \
        [LocalPool(1, **common) for _ in range(replicas)]
    result = RunResult()
    label = "p2p" if sharing else "local-only"
    if routes is None:
        label += " prefix-hint"
    try:
        for p in pools:
            p.start()
        sidecars = [sc for p in pools for sc in p.sidecars]
        clients = [sc.client(timeout=settings.timeout_seconds) for sc in sidecars]
        picker = PrefixHintPicker(sidecars, settings.timeout_seconds) if routes is None else None
        start = last = time.monotonic()
        size = settings.chunk_bytes
        for r, req in enumerate(keys):
            pod = picker.pick(req) if picker is not None else routes[r]  # type: ignore[index]
            result.routes.append(pod)
            out = serve_request(clients[pod], req, size, settings.timeout_seconds)
            loaded = out.loaded
            local = min(out.local, loaded)
            result.outcomes.append((local, loaded - local, len(req)))
            result.mismatched_chunks += out.mismatched
            result.local_hits += local
            result.peer_hits += loaded - local
            result.peer_hit_requests += loaded > out.local
            result.total_chunks += len(req)
            now = time.monotonic()
            if progress and (now - last >= 2.0 or r + 1 == len(keys)):
                last = now
                progress(f"[replay {label} x{replicas}] {r + 1}/{len(keys)} requests  "
                         f"hit ratio {result.hit_ratio:.3f}  ({now - start:.0f} s)")
        result.seconds = time.monotonic() - start
        result.hinted = picker.hinted if picker is not None else 0
        for c in clients:
            c.close()
        samples = [scrape.scrape(f"{sc.url}/metrics") for sc in sidecars]
        result.lookup_messages = scrape.total(samples, "kv_offload_lookup_messages_total")
        result.owner_queries = scrape.total(samples, "kv_offload_location_messages_total", kind="locate") - \
            scrape.total(samples, "kv_offload_route_hint_messages_total", kind="locate")
        result.hint_messages = scrape.total(samples, "kv_offload_route_hint_messages_total")
        result.bytes_moved = scrape.total(samples, "kv_offload_peer_bytes_total",
                                          direction="received")
    finally:
        for p in pools:
            p.stop()
    return result


# ---- report and plot ----------------------------------------------------------------

def run_replay(settings: ReplaySettings, sweep_replicas: Sequence[int] = (),
               plot: str | None = None, progress: Progress | None = None) -> ReplayReport:
    _validate(settings)
    requests = load_workload(settings)
    trace = [r.hash_ids for r in requests]
    sessions = [r.session for r in requests]
    keys = request_keys(trace)
    n, cap = settings.replicas, settings.capacity_chunks
    hinted = settings.routing == "prefix-hint"
    routes = None if hinted else route(trace, n, settings.routing, settings.seed, sessions)
    started = time.monotonic()
    p2p = replay_real(settings, keys, routes, n, sharing=True, progress=progress)
    routes = p2p.routes
    local = replay_real(settings, keys, routes, n, sharing=False, progress=progress)
    pooled = simulate_lru(keys, [0] * len(keys), 1, n * cap)
    ideal = simulate_lru(keys, [0] * len(keys), 1, math.inf)
    report = ReplayReport(
        replicas=n, capacity_chunks=cap, chunk_bytes=settings.chunk_bytes,
        routing=settings.routing, requests=len(keys), chunks=p2p.total_chunks,
        p2p_hit_ratio=p2p.hit_ratio, local_only_hit_ratio=local.hit_ratio,
        pooled_lru_hit_ratio=pooled, ideal_hit_ratio=ideal,
        lookup_messages_per_request=p2p.lookup_messages / len(keys),
        lookup_messages_per_peer_hit_request=_per(p2p.lookup_messages, p2p.peer_hit_requests),
        bytes_moved=int(p2p.bytes_moved), p2p_local_hits=p2p.local_hits,
        p2p_peer_hits=p2p.peer_hits, mismatched_chunks=p2p.mismatched_chunks + local.mismatched_chunks,
        seconds=0.0, workload=(f"conversation {settings.sessions}x{settings.turns}, think "
                                f"{settings.think_seconds:g} s" if settings.generate
                               else f"trace {settings.trace}"),
        owner_queries_per_request=p2p.owner_queries / len(keys),
        holder_exchanges_per_peer_hit_request=_per(p2p.lookup_messages - p2p.owner_queries,
                                                   p2p.peer_hit_requests),
        peer_copies=settings.peer_copies, bytes_moved_per_hit=_per(p2p.bytes_moved, p2p.hit_chunks))
    for m in sweep_replicas:
        if m == n:
            run = p2p
        else:
            run = replay_real(settings, keys, None if hinted else
                              route(trace, m, settings.routing, settings.seed, sessions),
                              m, sharing=True, progress=progress)
            report.mismatched_chunks += run.mismatched_chunks
        m_routes = run.routes
        report.sweep.append({
            "replicas": m, "p2p_hit_ratio": run.hit_ratio,
            "local_only_hit_ratio_simulated": simulate_lru(keys, m_routes, m, cap),
            "pooled_lru_hit_ratio": simulate_lru(keys, [0] * len(keys), 1, m * cap),
            "lookup_messages_per_request": run.lookup_messages / len(keys),
            "lookup_messages_per_peer_hit_request": _per(run.lookup_messages,
                                                         run.peer_hit_requests),
            "bytes_moved": int(run.bytes_moved),
            "bytes_moved_per_hit": _per(run.bytes_moved, run.hit_chunks)})
    report.prefill = prefill_savings(settings.prefill, p2p.outcomes)
    report.hinted_requests = p2p.hinted
    report.hint_messages_per_request = p2p.hint_messages / len(keys)
    report.seconds = time.monotonic() - started
    if plot:
        report.plot = write_plot(plot, report, keys, routes)
    return report


def load_workload(settings: ReplaySettings) -> list[TraceRequest]:
    """The requests to replay: generated (``--generate``) or read from ``--trace``."""
    if settings.generate == "conversation":
        requests = conversation(ConversationSpec(sessions=settings.sessions, turns=settings.turns,
                                                 think_seconds=settings.think_seconds, seed=settings.seed))
    else:
        requests = load_requests(settings.trace)
    return requests if settings.limit is None else requests[:settings.limit]


def _per(count: float, requests: int) -> float:
    return count / requests if requests else 0.0


def write_plot(path: str, report: ReplayReport, keys, routes) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, cap = report.replicas, report.capacity_chunks
    caps = sorted({max(1, int(cap * f)) for f in (0.125, 0.25, 0.5, 1, 2, 4, 8)})
    panels = 2 if report.sweep else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot(caps, [simulate_lru(keys, [0] * len(keys), 1, n * c) for c in caps], "o-",
            label=f"pooled LRU, {n} x capacity (simulated)")
    ax.plot(caps, [simulate_lru(keys, routes, n, c) for c in caps], "s--",
            label="local only (simulated)")
    ax.axhline(report.ideal_hit_ratio, color="grey", ls=":", label="ideal (infinite capacity)")
    ax.plot([cap], [report.p2p_hit_ratio], "r*", ms=14, label="kv-offload P2P (measured)")
    ax.plot([cap], [report.local_only_hit_ratio], "kx", ms=10, label="local only (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity per replica (chunks)")
    ax.set_ylabel("chunk hit ratio")
    ax.set_title(f"{n} replicas, {report.routing}, {report.requests} requests")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper left")
    if report.sweep:
        ax2 = axes[0][1]
        xs = [s["replicas"] for s in report.sweep]
        ax2.plot(xs, [s["p2p_hit_ratio"] for s in report.sweep], "r*-", ms=10,
                 label="kv-offload P2P (measured)")
        ax2.plot(xs, [s["pooled_lru_hit_ratio"] for s in report.sweep], "o-",
                 label="pooled LRU (simulated)")
        ax2.plot(xs, [s["local_only_hit_ratio_simulated"] for s in report.sweep], "s--",
                 label="local only (simulated)")
        ax2.set_xlabel(f"replicas ({cap} chunks each)")
        ax2.set_ylabel("chunk hit ratio")
        ax2.set_ylim(0, 1)
        ax2.set_xticks(xs)
        twin = ax2.twinx()
        twin.plot(xs, [s["lookup_messages_per_request"] for s in report.sweep], "g^:",
                  label="peer messages / request (measured)")
        twin.plot(xs, [s.get("lookup_messages_per_peer_hit_request", 0.0) for s in report.sweep],
                  "gv-", label="peer messages / peer-hit request (measured)")
        twin.plot(xs, [x - 1 for x in xs], color="grey", ls="-.", lw=1,
                  label="asking every peer (N - 1)")
        twin.set_ylabel("peer lookup messages per request", color="g")
        twin.set_ylim(0, max(xs) * 1.05)
        ax2.legend(fontsize=8, loc="upper left")
        twin.legend(fontsize=8, loc="upper right")
        ax2.set_title("hit ratio and lookup cost against replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(report: ReplayReport, prefill_model: PrefillSettings = PrefillSettings()) -> str:
    rows = [("p2p_hit_ratio (measured)", f"{report.p2p_hit_ratio:.4f}"),
            ("local_only_hit_ratio (measured)", f"{report.local_only_hit_ratio:.4f}"),
            ("pooled_lru_hit_ratio (simulated)", f"{report.pooled_lru_hit_ratio:.4f}"),
            ("ideal_hit_ratio", f"{report.ideal_hit_ratio:.4f}"),
            ("p2p / pooled LRU", f"{report.p2p_hit_ratio / report.pooled_lru_hit_ratio:.3f}"
             if report.pooled_lru_hit_ratio else "-"),
            ("lookup_messages_per_request", f"{report.lookup_messages_per_request:.3f}"),
            ("lookup_messages_per_peer_hit_request",
             f"{report.lookup_messages_per_peer_hit_request:.3f}"),
            ("owner_queries_per_request", f"{report.owner_queries_per_request:.3f}"),
            ("holder_exchanges_per_peer_hit_request", f"{report.holder_exchanges_per_peer_hit_request:.3f}"),
            ("hinted_requests", f"{report.hinted_requests}"),
            ("hint_messages_per_request", f"{report.hint_messages_per_request:.3f}"),
            ("bytes_moved", f"{report.bytes_moved}"),
            ("bytes_moved_per_hit", f"{report.bytes_moved_per_hit:.0f}"),
            ("mismatched chunks", f"{report.mismatched_chunks}")]
    w = max(len(r[0]) for r in rows)
    head = (f"replay of {report.workload}: {report.requests} requests, {report.chunks} chunks, {report.replicas} "
            f"replicas x {report.capacity_chunks} chunks of {report.chunk_bytes} B, "
            f"{report.routing}, peer copies: {report.peer_copies}")
    lines = [head] + [f"  {a.ljust(w)}  {b}" for a, b in rows]
    if report.sweep:
        lines.append("  replicas  p2p     pooled  local(sim)  msgs/request  msgs/peer-hit request")
        for s in report.sweep:
            lines.append(f"  {s['replicas']:<8}  {s['p2p_hit_ratio']:.4f}  "
                         f"{s['pooled_lru_hit_ratio']:.4f}  "
                         f"{s['local_only_hit_ratio_simulated']:.4f}      "
                         f"{s['lookup_messages_per_request']:.3f}         "
                         f"{s.get('lookup_messages_per_peer_hit_request', 0.0):.3f}")
    if report.prefill:
        lines += format_rows(prefill_model, report.prefill)
    if report.plot:
        lines.append(f"  plot: {report.plot}")
    return "\n".join(lines)


def _compare(args: argparse.Namespace) -> int:
    from kv_offload_tools.bench.replay.compare import format_comparison, load_reports, write_comparison_plot

    try:
        reports = load_reports([p for p in args.compare.split(",") if p.strip()])
    except ValueError as exc:
        raise UsageError(f"kv-offload bench replay: {exc}") from None
    print(format_comparison(reports))
    if args.plot:
        print(f"  plot: {write_comparison_plot(args.plot, reports)}")
    return 0


def _validate(s: ReplaySettings) -> None:
    if s.replicas < 1:
        raise ValueError(f"--replicas {s.replicas} must be at least 1")
    if s.capacity_chunks < 1:
        raise ValueError(f"--capacity-chunks {s.capacity_chunks} must be at least 1")
    if not 64 <= s.chunk_bytes <= 64 << 20:
        raise ValueError(f"--chunk-bytes {s.chunk_bytes} must be between 64 and {64 << 20}")
    if s.routing not in ROUTINGS:
        raise ValueError(f"--routing {s.routing!r} must be one of {', '.join(ROUTINGS)}")
    if s.limit is not None and s.limit < 1:
        raise ValueError(f"--limit {s.limit} must be at least 1")
    if s.publish_interval_seconds <= 0:
        raise ValueError("--publish-interval-seconds must be positive")
    if (s.generate is None) == (not s.trace):
        raise ValueError("give either --trace FILE or --generate conversation (not both, not neither)")
    if s.generate is not None and s.generate not in WORKLOADS:
        raise ValueError(f"--generate {s.generate!r} must be one of {', '.join(WORKLOADS)}")
    if s.sessions < 1 or s.turns < 1:
        raise ValueError(f"--sessions {s.sessions} and --turns {s.turns} must be at least 1")
    if s.think_seconds < 0:
        raise ValueError(f"--think-seconds {s.think_seconds} must not be negative")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="", help="Mooncake-format JSONL trace")
    parser.add_argument("--generate", choices=WORKLOADS, default=None,
                        help="replay a generated workload instead of a trace: chat sessions whose "
                             "turns extend the previous prompt, with think times and shared system prompts")
    parser.add_argument("--sessions", type=int, default=200, help="sessions of --generate conversation")
    parser.add_argument("--turns", type=int, default=6, help="turns per session of --generate conversation")
    parser.add_argument("--think-seconds", type=float, default=20.0,
                        help="mean seconds a user thinks between turns of --generate conversation "
                             "(default 20; longer keeps more sessions open at once)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random routing and of --generate")
    parser.add_argument("--write-trace", default="",
                        help="also write the replayed requests as a Mooncake-format trace (with session_id)")
    parser.add_argument("--compare", default="", metavar="A.json,B.json",
                        help="replay nothing: print reports written by --json side by side (and --plot them)")
    parser.add_argument("--replicas", type=int, default=0, help="vLLM replicas (sidecars)")
    parser.add_argument("--capacity-chunks", type=int, default=0,
                        help="chunk slots of each replica's sidecar store")
    parser.add_argument("--chunk-bytes", type=int, default=4096,
                        help="bytes of one chunk (default 4096)")
    parser.add_argument("--routing", choices=ROUTINGS, default="round-robin")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default="replay.png",
                        help="PNG written with the hit-ratio plot ('' for none; default replay.png)")
    parser.add_argument("--sweep-replicas", default="",
                        help="also measure P2P at these replica counts, e.g. 4,8,16")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="tcp")
    parser.add_argument("--peer-copies", choices=PEER_COPIES, default="drop",
                        help="the sidecars' sharing policy: drop a fetched chunk once loaded (default) "
                             "or keep it at the cold end")
    # The prefill model's flags and the publish interval take their defaults from the settings.
    model = PrefillSettings()
    parser.add_argument("--prefill-tokens-per-second", type=float, default=model.tokens_per_second,
                        help="prefill model: the engine's prompt tokens per second "
                             f"(default {model.tokens_per_second:g})")
    parser.add_argument("--tokens-per-chunk", type=int, default=model.tokens_per_chunk,
                        help=f"prefill model: tokens of one replayed chunk (default {model.tokens_per_chunk}, "
                             "a Mooncake block)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=model.kv_bytes_per_token,
                        help=f"prefill model: KV bytes per token (default {model.kv_bytes_per_token}: "
                             "Llama-3-8B in bf16)")
    gbps = ",".join(f"{b / 1e9:g}" for b in model.links)
    parser.add_argument("--links", default=gbps, help=f"prefill model: link bandwidths in GB/s (default {gbps})")
    parser.add_argument("--link-latency-ms", type=float, default=model.latency_seconds * 1000,
                        help="prefill model: round trip of one holder exchange "
                             f"(default {model.latency_seconds * 1000:g})")
    interval = ReplaySettings.publish_interval_seconds
    parser.add_argument("--publish-interval-seconds", type=float, default=interval,
                        help=f"sidecars' directory publish interval (default {interval:g})")

def run(args: argparse.Namespace) -> int:
    if args.compare:
        return _compare(args)
    try:
        sweep = [int(x) for x in args.sweep_replicas.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"kv-offload bench replay: --sweep-replicas {args.sweep_replicas!r} must be "
                         "comma-separated integers, e.g. 4,8,16") from None
    if any(m < 1 for m in sweep):
        raise UsageError("kv-offload bench replay: --sweep-replicas values must be at least 1")
    try:
        links = tuple(float(x) * 1e9 for x in args.links.split(",") if x.strip())
        prefill = PrefillSettings(tokens_per_second=args.prefill_tokens_per_second,
                                  tokens_per_chunk=args.tokens_per_chunk,
                                  kv_bytes_per_token=args.kv_bytes_per_token, links=links,
                                  latency_seconds=args.link_latency_ms / 1000)
    except ValueError as exc:
        raise UsageError(f"kv-offload bench replay: {exc} (--links takes GB/s values such as 1.25,25)") from None
    settings = ReplaySettings(
        trace=args.trace, replicas=args.replicas, capacity_chunks=args.capacity_chunks,
        chunk_bytes=args.chunk_bytes, routing=args.routing, limit=args.limit,
        transport=args.transport, publish_interval_seconds=args.publish_interval_seconds,
        seed=args.seed, generate=args.generate, sessions=args.sessions, turns=args.turns,
        think_seconds=args.think_seconds,
        peer_copies=args.peer_copies, prefill=prefill)
    if settings.transport == "ucx":
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    try:
        if args.write_trace:
            _validate(settings)
            write_requests(args.write_trace, load_workload(settings))
        report = run_replay(settings, sweep, args.plot or None, progress=to_stderr)
    except ValueError as exc:
        raise UsageError(f"kv-offload bench replay: {exc}") from None
    print(json.dumps(asdict(report)) if args.json else format_table(report, prefill))
    return 1 if report.mismatched_chunks else 0
