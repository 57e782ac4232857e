"""The sidecar's read on ``bench replay``'s workloads: messages by holders per prefix.

``bench scale``'s pod-count rows replay a small chat workload per pod; this
part replays the workloads ``kv-offload bench replay`` runs on real sidecar
processes (chat conversations of 6 turns, users thinking 240 s, 1,000-chunk
stores; the Mooncake trace with 3,000-chunk stores; round-robin routing) through
the same in-process pool (``scale_lookups.replay_lookups``: every member's real
``Location`` and ``PeerReads``) at a few replica counts, so its messages per
request can be set beside those the real processes counted. The directory is
up to date at every request (a publish between two requests); ``bench replay``'s
sidecars publish every 50 ms while its requests come about 21 ms apart, so there a
chunk stored within the last publish interval is not known yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_tools.bench.replay.cli import request_keys
from kv_offload_tools.bench.scale.lookups import replay_lookups
from kv_offload_tools.mooncake_trace import TraceRequest, load_requests
from kv_offload_tools.workloads import ConversationSpec, conversation

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ReadWorkload:
    """One stream the read is replayed on."""

    # "conversation" or "trace".
    name: str
    # Chunk slots of each replica's store.
    capacity_chunks: int
    # The requests, in arrival order.
    requests: tuple[TraceRequest, ...]


def workloads(sessions: int, trace: str, seed: int = 0) -> list[ReadWorkload]:
    """``bench replay``'s conversations (``sessions`` x 6 turns, 240 s think time, 1,000-chunk
    stores), and the trace at ``trace`` (3,000-chunk stores) unless it is ''."""
    out = []
    if sessions:
        out.append(ReadWorkload("conversation", 1000, tuple(conversation(
            ConversationSpec(sessions=sessions, turns=6, think_seconds=240.0, seed=seed)))))
    if trace:
        out.append(ReadWorkload("trace", 3000, tuple(load_requests(trace))))
    return out


def replay_reads(loads: Sequence[ReadWorkload], replicas: Sequence[int], progress: Progress) -> list[dict[str, Any]]:
    """One row per workload and replica count: hit ratio, messages, and by holders per prefix."""
    rows = []
    for load in loads:
        keys = request_keys([r.hash_ids for r in load.requests])
        stream = [(float(i), k) for i, k in enumerate(keys)]  # one publish between two requests
        for n in replicas:
            progress(f"[scale reads] {load.name}: {len(stream)} requests over {n} replicas, round-robin")
            f = replay_lookups("directory", n, stream, capacity=load.capacity_chunks, interval=1.0,
                               routing="round-robin", progress=progress)
            rows.append({"workload": load.name, "replicas": n, "requests": f.requests,
                         "capacity_chunks": load.capacity_chunks, "hit_ratio": f.hit_ratio,
                         "messages_per_request": f.messages_per_lookup,
                         "owner_questions_per_request": f.locate_messages / max(f.requests, 1),
                         "messages_per_peer_hit_request": f.messages_per_peer_hit_request,
                         "all_messages_per_peer_hit_request": f.all_messages_per_peer_hit_request,
                         "peer_hit_requests": f.peer_hit_requests,
                         "false_positive_ratio": f.false_positive_ratio,
                         "by_holders": f.holders_view(), "seconds": f.seconds})
    return rows
