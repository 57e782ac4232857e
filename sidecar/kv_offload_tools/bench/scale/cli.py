"""`kv-offload bench scale`: where-is-what as the pool grows, from the sidecar's own location code.

For each pod count it runs the chunk directory's real classes (``OwnerTable``,
``Publisher``, ``Directory``, messages as their JSON bodies, HTTP overhead
measured on a real aiohttp exchange) in this process:

1. ``lookups``: every member with a small store replays generated chat
   conversations, once with the directory (each member's real ``Location`` and
   ``PeerReads``: the sidecar's read, from holder to holder) and once with the
   exact scheme (every peer's exact set, the previous design): messages per
   lookup and per peer-hit request (by holders per prefix), false-positive peer
   lookups, hit ratio against exact, owner-query sizes, store changes per request.
2. ``sample``: sampled members at full size (``--chunks-per-pod``,
   ``--changes-per-second``) with the rest modelled by the same Publisher
   restricted to the sampled members' buckets: location memory of one
   sidecar (measured), publish bytes and messages per second, join and
   leave costs.
3. Owner queries per second follow from the request rate that makes
   ``--changes-per-second`` (changes per request from 1.) and their measured
   sizes. ``alternatives`` costs the exact scheme and per-peer Bloom
   filters from measured entry sizes and rates.
4. ``links``: links per sidecar: the peers a member exchanged chunks with within
   ``DATA_IDLE_SECONDS`` (from 1.'s replay: its data links, target <= ``MAX_DATA_LINKS``),
   and the peers it exchanged location messages with within ``CONTROL_KEEPALIVE_SECONDS``
   (owner questions from 1., publishes from 2. at full size) with the connections per
   second the bounded control client opens for them.
5. ``reads``: the same read on ``bench replay``'s workloads (its
   conversations; with ``--trace``, a Mooncake trace) at ``--read-replicas``.

A request whose prefix is read from k holders in turn costs at most 2k + 1
messages (an owner question, none when the member owns the key, and an
exchange per holder; an owner question for the first key nobody holds) plus
one per false exchange: ``meets_targets`` checks that bound for every k met,
in place of the one-holder target of 2.

Prints a table (or ``--json``: one object with a ``results`` list, one entry
per pod count, and a ``reads`` list) and writes a PNG of every figure against pods.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kv_offload_sidecar.peers.control_client import CONTROL_CONNECTIONS, CONTROL_KEEPALIVE_SECONDS
from kv_offload_sidecar.peers.data_links import DATA_IDLE_SECONDS, MAX_DATA_LINKS
from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.bench.scale import alternatives as alt
from kv_offload_tools.bench.replay.cli import request_keys
from kv_offload_tools.bench.scale.lookups import LookupFigures, replay_lookups
from kv_offload_tools.bench.scale.measure import HttpOverhead, handshake_bytes, http_overhead
from kv_offload_tools.bench.scale.reads import replay_reads, workloads
from kv_offload_tools.bench.scale.report import format_table, write_plot
from kv_offload_tools.bench.scale.sample import SampleFigures, sample_pool
from kv_offload_tools.progress import to_stderr
from kv_offload_tools.workloads import ConversationSpec, conversation

Progress = Callable[[str], None]
# The targets at 1,024 pods x 100k chunks x 1k changes/s/pod.
TARGETS = {"location_bytes_per_sidecar": 64 << 20, "control_bytes_per_second_per_pod": 1_000_000,
           "false_positive_ratio": 0.01, "hit_ratio_vs_exact": 0.97, "links_per_sidecar": MAX_DATA_LINKS}
# Which way each target points: True when the figure must stay at or below it.
AT_MOST = {"location_bytes_per_sidecar": True, "control_bytes_per_second_per_pod": True,
           "false_positive_ratio": True, "hit_ratio_vs_exact": False, "links_per_sidecar": True}
# The messages' bound, checked per number of holders k: a peer-hit request over k holders.
MESSAGES_BOUND = "messages_per_peer_hit_request <= 2k + 1 (+ false exchanges) for k holders read"


@dataclass(frozen=True)
class ScaleSettings:
    # Pod counts, e.g. (16, 64, 256, 1024).
    pods: tuple[int, ...]
    # Chunks each pod's store holds (the sampled sidecars hold exactly this many).
    chunks_per_pod: int = 100_000
    # Store changes per second per pod (half stores, half evictions).
    changes_per_second: float = 1000.0
    # Seconds between publishes (the sidecar's --publish-interval-seconds).
    publish_interval_seconds: float = 1.0
    # Steady-state seconds the sampled sidecars run for.
    seconds: float = 5.0
    # Sidecars run in full at each pod count (the rest modelled).
    sample: int = 2
    # Chat sessions per pod in the lookup replay.
    sessions_per_pod: int = 4
    # Turns (requests) per session.
    turns: int = 4
    # Store capacity (chunks) of each member in the lookup replay.
    replay_capacity_chunks: int = 256
    # Seed of every random choice.
    seed: int = 0
    # Replica counts of the read on bench replay's workloads (() for none).
    read_replicas: tuple[int, ...] = (4, 8, 16)
    # Sessions of bench replay's conversations in that part (6 turns each; 0 for none).
    read_sessions: int = 2000
    # Mooncake trace replayed in that part too ("" for none).
    trace: str = ""


def workload(pods: int, s: ScaleSettings) -> list[tuple[float, list[bytes]]]:
    """Chat conversations for ``pods`` members: sessions arrive over ~60 s, users think ~20 s."""
    sessions = pods * s.sessions_per_pod
    reqs = conversation(ConversationSpec(sessions=sessions, turns=s.turns, arrival_seconds=60.0 / sessions,
                                         think_seconds=20.0, seed=s.seed))
    keys = request_keys([r.hash_ids for r in reqs])
    return [(r.timestamp_ms / 1000.0, k) for r, k in zip(reqs, keys)]


def measure(pods: int, s: ScaleSettings, overhead: HttpOverhead, handshake: int, entry_bytes: float,
            progress: Progress) -> dict[str, Any]:
    """Every figure of one pod count."""
    started = time.monotonic()
    stream = workload(pods, s)
    lifetime = s.chunks_per_pod / (s.changes_per_second / 2)  # how long a chunk stays in a store
    runs: dict[str, LookupFigures] = {}
    for scheme in ("directory", "exact"):
        progress(f"[scale x{pods}] replaying {len(stream)} requests with the {scheme} scheme")
        runs[scheme] = replay_lookups(scheme, pods, stream, capacity=s.replay_capacity_chunks,
                                      interval=s.publish_interval_seconds, lifetime_seconds=lifetime,
                                      seed=s.seed, progress=progress)
    d, e = runs["directory"], runs["exact"]
    requests_per_second = s.changes_per_second / max(d.changes_per_request, 1e-9)
    sample: SampleFigures = sample_pool(
        pods, s.chunks_per_pod, s.changes_per_second, requests_per_second,
        interval=s.publish_interval_seconds, seconds=s.seconds, samples=s.sample, overhead=overhead,
        handshake_bytes=handshake, seed=s.seed, progress=progress)
    locates = requests_per_second * d.locate_messages / max(d.requests, 1)
    per_locate = (d.locate_query_bytes + d.locate_reply_bytes) / max(d.locate_messages, 1) + \
        overhead.request + overhead.response
    # Each way: its own queries and the replies it gives as an owner (as many, by symmetry).
    locate_each_way = locates * per_locate
    out_bps = sample.publish_bytes_out_per_second + locate_each_way
    in_bps = sample.publish_bytes_in_per_second + locate_each_way
    bits, k, rate = alt.bloom_shape(pods, TARGETS["false_positive_ratio"])
    exact = alt.exact_costs(pods, s.chunks_per_pod, s.changes_per_second, s.publish_interval_seconds,
                            overhead, entry_bytes)
    bloom = alt.bloom_costs(pods, s.chunks_per_pod, s.changes_per_second, s.publish_interval_seconds,
                            overhead, bits, k)
    row: dict[str, Any] = {
        "pods": pods,
        "location_bytes_per_sidecar": sample.location_bytes_per_sidecar,
        "control_bytes_per_second_per_pod": out_bps + in_bps,
        "control_bytes_out_per_second_per_pod": out_bps,
        "control_bytes_in_per_second_per_pod": in_bps,
        "control_messages_per_second_per_pod": sample.publish_messages_out_per_second + locates,
        "messages_per_lookup": d.messages_per_lookup,
        "messages_per_peer_hit_request": d.messages_per_peer_hit_request,
        "all_messages_per_peer_hit_request": d.all_messages_per_peer_hit_request,
        "by_holders": d.holders_view(),
        "false_positive_ratio": d.false_positive_ratio,
        "hit_ratio": d.hit_ratio,
        "exact_hit_ratio": e.hit_ratio,
        "hit_ratio_vs_exact": d.hit_ratio / e.hit_ratio if e.hit_ratio else 1.0,
        "join": sample.join,
        "leave": sample.leave,
        "memory_breakdown": sample.memory_breakdown,
        "directory_entries_per_sidecar": sample.directory_entries,
        "publish": {"bytes_out_per_second": sample.publish_bytes_out_per_second,
                    "bytes_in_per_second": sample.publish_bytes_in_per_second,
                    "messages_out_per_second": sample.publish_messages_out_per_second,
                    "messages_in_per_second": sample.publish_messages_in_per_second},
        "locate": {"per_second": locates, "bytes_each_way_per_second": locate_each_way,
                   "query_bytes": d.locate_query_bytes / max(d.locate_messages, 1),
                   "reply_bytes": d.locate_reply_bytes / max(d.locate_messages, 1)},
        "requests_per_second_per_pod": requests_per_second,
        "replay": {"requests": d.requests, "chunks": d.chunks, "capacity_chunks": s.replay_capacity_chunks,
                   "directory": _replay_view(d), "exact": _replay_view(e)},
        "alternatives": {
            "exact": {**asdict(exact), "messages_per_peer_hit_request": e.messages_per_peer_hit_request,
                      "false_positive_ratio": e.false_positive_ratio, "entry_bytes": entry_bytes},
            "bloom": {**asdict(bloom), "bits_per_entry": bits, "hashes": k, "per_filter_rate": rate,
                      "per_filter_rate_measured": alt.bloom_measured_rate(bits, k) if pods <= 256 else None}},
        # Data links a member opens (holders it read from within an idle window, the worst
        # member's peak): at most MAX_DATA_LINKS are open whatever this says.
        "links_per_sidecar": d.data_peers_read_from.get("max", 0.0),
        "links": links_view(d, sample),
        "sampled_sidecars": sample.sampled,
        "modelled_sidecars": sample.modelled,
        "seconds": time.monotonic() - started,
    }
    row["meets_targets"] = {name: (row[name] <= goal if AT_MOST[name] else row[name] >= goal)
                            for name, goal in TARGETS.items()}
    row["meets_targets"]["messages_per_peer_hit_request"] = within_bound(row["by_holders"])
    progress(f"[scale x{pods}] memory {row['location_bytes_per_sidecar'] / 2**20:.1f} MiB, control "
             f"{row['control_bytes_per_second_per_pod'] / 1e6:.3f} MB/s, {row['messages_per_peer_hit_request']:.2f} "
             f"msgs/peer-hit request, fp {row['false_positive_ratio']:.4f}, hit ratio x{row['hit_ratio_vs_exact']:.3f} "
             f"of exact ({row['seconds']:.0f} s)")
    return row


def links_view(d: LookupFigures, sample: SampleFigures) -> dict[str, Any]:
    """Links per sidecar: data peers per idle window (replay), control peers per keep-alive
    (owner questions in the replay; publishes at full size, sampled), the bounds, and the
    connections per second the bounded control client opens for the publishes."""
    return {"data_peers_per_window": d.data_peers, "data_idle_seconds": DATA_IDLE_SECONDS,
            "holders_read_from_per_window": d.data_peers_read_from,
            "readers_per_window": d.data_peers_reading,
            "max_data_links": MAX_DATA_LINKS,
            "replay_control_peers_per_window": d.control_peers,
            "publish_peers_per_window": sample.control_peers,
            "control_keepalive_seconds": CONTROL_KEEPALIVE_SECONDS, "control_connections": CONTROL_CONNECTIONS,
            "control_connection_opens_per_second": sample.control_opens_per_second,
            "control_within_bound": sample.control_peers.get("max", 0.0) <= CONTROL_CONNECTIONS}


def within_bound(by_holders: dict[str, dict[str, float]]) -> bool:
    """True when the requests over k holders averaged at most 2k + 1 messages (plus their false
    exchanges), for every k."""
    return all(v["messages_per_request"] <= 2 * int(k) + 1 + v["false_exchanges_per_request"] + 1e-9
               for k, v in by_holders.items())


def _replay_view(f: LookupFigures) -> dict[str, Any]:
    return {"hit_ratio": f.hit_ratio, "local_hits": f.local_hits, "peer_hits": f.peer_hits,
            "peer_hit_requests": f.peer_hit_requests, "messages_per_lookup": f.messages_per_lookup,
            "messages_per_peer_hit_request": f.messages_per_peer_hit_request,
            "by_holders": f.holders_view(),
            "false_positive_ratio": f.false_positive_ratio, "changes_per_request": f.changes_per_request,
            "seconds": f.seconds}


def run_scale(s: ScaleSettings, progress: Progress) -> dict[str, Any]:
    overhead = http_overhead()
    handshake = handshake_bytes(overhead)
    entry_bytes = alt.exact_entry_bytes()
    progress(f"HTTP adds {overhead.request} B to a request and {overhead.response} B to a reply; "
             f"a handshake moves {handshake} B; the exact scheme's entry takes {entry_bytes:.1f} B")
    rows = [measure(n, s, overhead, handshake, entry_bytes, progress) for n in s.pods]
    reads = replay_reads(workloads(s.read_sessions, s.trace, s.seed), s.read_replicas, progress) \
        if s.read_replicas else []
    for r in reads:
        r["within_bound"] = within_bound(r["by_holders"])
    return {
        "settings": asdict(s),
        "http_overhead": asdict(overhead),
        "handshake_bytes": handshake,
        "targets": TARGETS,
        "messages_bound": MESSAGES_BOUND,
        "notes": [
            f"per-sidecar memory and publish traffic come from {min(s.sample, min(s.pods))} sampled sidecars "
            "run in full (real Publisher/Directory/OwnerTable, JSON bodies); the other members are modelled by "
            "the same Publisher holding only their chunks in the sampled sidecars' buckets",
            "lookup figures and hit ratios come from every member running the real classes (Location, "
            "PeerReads: messages as its kv_offload_lookup_messages_total counts them) on a replay of "
            f"generated chat conversations with {s.replay_capacity_chunks}-chunk stores whose chunks live as long "
            f"as in a {s.chunks_per_pod}-chunk store at the configured changes "
            f"({s.chunks_per_pod / (s.changes_per_second / 2):.0f} s)",
            "owner queries per second = (changes per second / store changes per request) x owner queries per "
            "request; the alternatives are costed from measured entry sizes and filter rates",
            f"links per sidecar: the distinct peers a member exchanged chunks with (both ways) within "
            f"{DATA_IDLE_SECONDS:g} s (a data link closes after that idle; at most {MAX_DATA_LINKS} open), "
            f"in the replay; control peers: distinct peers it exchanged publishes with within the "
            f"{CONTROL_KEEPALIVE_SECONDS:g} s keep-alive at full size (sampled sidecars), through a client of at "
            f"most {CONTROL_CONNECTIONS} connections: past that, connections are opened and closed instead "
            "(opens per second of its own publishes)"],
        "results": rows,
        "reads": reads,
    }


def _pods(text: str, flag: str = "--pods", example: str = "16,64,256,1024") -> tuple[int, ...]:
    try:
        pods = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"kv-offload bench scale: {flag} {text!r} must be comma-separated integers, "
                         f"e.g. {example}") from None
    if (not pods and flag == "--pods") or any(p < 2 for p in pods):
        raise UsageError(f"kv-offload bench scale: {flag} needs pod counts of at least 2")
    return pods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", default="16,64,256,1024", help="pod counts (default 16,64,256,1024)")
    parser.add_argument("--chunks-per-pod", type=int, default=100_000, help="chunks each store holds")
    parser.add_argument("--changes-per-second", type=float, default=1000.0,
                        help="store changes per second per pod (default 1000)")
    parser.add_argument("--publish-interval-seconds", type=float, default=1.0,
                        help="the sidecars' publish interval (default 1.0)")
    parser.add_argument("--seconds", type=float, default=5.0, help="steady-state seconds measured (default 5)")
    parser.add_argument("--sample", type=int, default=2, help="sidecars run in full per pod count (default 2)")
    parser.add_argument("--sessions-per-pod", type=int, default=4, help="chat sessions per pod in the replay")
    parser.add_argument("--replay-capacity-chunks", type=int, default=256,
                        help="store capacity of each member in the lookup replay (default 256)")
    parser.add_argument("--read-replicas", default="4,8,16",
                        help="replica counts of the read on bench replay's workloads ('' for none)")
    parser.add_argument("--read-sessions", type=int, default=2000,
                        help="sessions of bench replay's conversations in that part (6 turns; 0 for none)")
    parser.add_argument("--trace", default="", help="a Mooncake trace replayed in that part too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default="scale.png", help="PNG of the figures against pods ('' for none)")


def run(args: argparse.Namespace) -> int:
    for name in ("chunks_per_pod", "sample", "sessions_per_pod", "replay_capacity_chunks"):
        if getattr(args, name) < 1:
            raise UsageError(f"kv-offload bench scale: --{name.replace('_', '-')} must be at least 1")
    for name in ("changes_per_second", "publish_interval_seconds", "seconds"):
        if getattr(args, name) <= 0:
            raise UsageError(f"kv-offload bench scale: --{name.replace('_', '-')} must be positive")
    if args.read_sessions < 0:
        raise UsageError(f"kv-offload bench scale: --read-sessions {args.read_sessions} must be 0 or more")
    if args.trace and not os.path.isfile(args.trace):
        raise UsageError(f"kv-offload bench scale: --trace {args.trace!r} is not a file")
    settings = ScaleSettings(pods=_pods(args.pods), chunks_per_pod=args.chunks_per_pod,
                             changes_per_second=args.changes_per_second,
                             publish_interval_seconds=args.publish_interval_seconds, seconds=args.seconds,
                             sample=args.sample, sessions_per_pod=args.sessions_per_pod,
                             replay_capacity_chunks=args.replay_capacity_chunks, seed=args.seed,
                             read_replicas=_pods(args.read_replicas, "--read-replicas", "4,8,16"),
                             read_sessions=args.read_sessions, trace=args.trace)
    report = run_scale(settings, to_stderr)
    if args.plot:
        report["plot"] = write_plot(args.plot, report)
    print(json.dumps(report) if args.json else format_table(report))
    return 0
