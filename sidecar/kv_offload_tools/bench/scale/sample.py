"""Per-sidecar figures of the chunk directory at full size: memory, publish traffic, joins, leaves.

The pool has ``pods`` members with ``chunks`` chunks each, every one changing
``changes_per_second`` of them (half stored, half evicted, the oldest first)
and republishing ``refreshes_per_second`` chain tails. A few *sampled*
sidecars run in full: their real ``Publisher`` holds all their chunks and
sends every message, their real ``Directory`` receives every message any
member sends them. The other members are *modelled* by the same
``Publisher`` code holding only their chunks in the sampled sidecars' buckets
(exactly the part of their store those sidecars hear about): what reaches the
sampled sidecars is what a full pod would send them. Messages travel as JSON
bodies (``to_dict``); bytes are those bodies plus the measured HTTP overhead.

Join: a fresh pod enters every view; the sampled members send it their share
(measured); it receives about N shares (modelled from the sampled ones) and
sends N empty ones (measured), after N handshakes each way (bodies measured).
Leave: a modelled member leaves; the sampled members resend the digests of its
buckets to their new owners (measured) and drop its entries (measured).
"""

from __future__ import annotations

from typing import Any

import json
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from kv_offload_sidecar.peers.directory.holders import Directory
from kv_offload_sidecar.peers.directory.location_wire import PublishBatch, PublishReply
from kv_offload_sidecar.peers.directory.ownership import BUCKET_BITS, OwnerTable
from kv_offload_sidecar.peers.directory.publisher import Publisher

from kv_offload_sidecar.peers.control_client import CONTROL_CONNECTIONS, CONTROL_KEEPALIVE_SECONDS

from kv_offload_tools.bench.scale.links import connection_opens, peers_in_window
from kv_offload_tools.bench.scale.measure import HttpOverhead, deep_size

Progress = Callable[[str], None]
_SHIFT = 64 - BUCKET_BITS


class SampledView:
    """The owner table as a modelled member uses it: it writes only to the sampled owners."""

    def __init__(self, table: OwnerTable, owners: Sequence[str]) -> None:
        self._table = table
        self._owners = list(owners)

    def members(self) -> list[str]:
        return self._owners

    def __contains__(self, owner: object) -> bool:
        return owner in self._owners

    def owner_of(self, digest: int) -> str:
        return self._table.owner_of(digest)

    def owners_of(self, digest: int) -> list[str]:
        """The digest's owners that are sampled (the others are modelled: nobody writes to them)."""
        return [o for o in self._table.owners_of(digest) if o in self._owners]

    def owned_mask(self, identity: str) -> Any:
        return self._table.owned_mask(identity)


@dataclass
class Traffic:
    """Bytes and messages one sidecar sent and received."""

    # Bytes sent and received (bodies plus HTTP overhead).
    out_bytes: int = 0
    in_bytes: int = 0
    # Messages sent and received.
    out_messages: int = 0
    in_messages: int = 0
    # Publish records received.
    records_in: int = 0


@dataclass
class SampleFigures:
    """What the sampled sidecars measured (per sidecar, the worst sample)."""

    # Sidecars run in full, and members modelled.
    sampled: int
    modelled: int
    # Location memory of one sidecar (bytes): held digests, directory share, owner table.
    location_bytes_per_sidecar: int
    # The same by part.
    memory_breakdown: dict[str, int]
    # Chunks the sidecar holds, and (chunk, holder) entries it keeps as an owner.
    held_chunks: int
    directory_entries: int
    # Publish traffic per second: bytes (bodies + HTTP) and messages, each way.
    publish_bytes_out_per_second: float
    publish_bytes_in_per_second: float
    publish_messages_out_per_second: float
    publish_messages_in_per_second: float
    # Distinct peers a sampled sidecar exchanged publishes with (sent or received) within
    # control_client.CONTROL_KEEPALIVE_SECONDS (``scale_links.peers_in_window``), and the
    # connections per second its own publishes open through the bounded control client.
    control_peers: dict[str, float] = field(default_factory=dict)
    control_opens_per_second: float = 0.0
    # What a fresh pod joining costs (see _join), and a member leaving (see _leave).
    join: dict[str, float] = field(default_factory=dict)
    leave: dict[str, float] = field(default_factory=dict)
    # Wall-clock seconds of the model.
    seconds: float = 0.0


class _Pod:
    """One member of the model: its publisher and the digests it holds, oldest first."""

    def __init__(self, name: str, view: OwnerTable | SampledView, owners: Sequence[str]) -> None:
        self.name = name
        self.view = view
        self.publisher = Publisher(name)
        for owner in owners:
            self.publisher.owner_joined(owner)
        self.fifo: deque[int] = deque()

    def store(self, digests: list[int]) -> None:
        for d in digests:
            self.publisher.record_digest(d, True)
        self.fifo.extend(digests)

    def evict(self, n: int) -> None:
        for _ in range(min(n, len(self.fifo))):
            self.publisher.record_digest(self.fifo.popleft(), False)


class _Model:
    def __init__(self, pods: int, chunks: int, samples: int, overhead: HttpOverhead, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.py_rng = random.Random(seed)
        self.overhead = overhead
        self.names = [f"pod-{i}" for i in range(pods)]
        self.table = OwnerTable(self.names[0])
        for n in self.names[1:]:
            self.table.add(n)
        self.sampled = self.names[:samples]
        mask = np.zeros(1 << BUCKET_BITS, dtype=bool)
        for s in self.sampled:
            mask |= self.table.owned_mask(s)
        self.buckets = np.flatnonzero(mask).astype(np.uint64)
        self.fraction = len(self.buckets) / (1 << BUCKET_BITS)
        self.directories = {s: Directory() for s in self.sampled}
        # The model's clock (seconds), and the publishes to or from a sampled sidecar: (t, from, to).
        self.now = 0.0
        self.contacts: list[tuple[float, str, str]] = []
        self.traffic = {s: Traffic() for s in self.sampled}
        view = SampledView(self.table, self.sampled)
        self.pods = [_Pod(n, self.table, self.names) if n in self.directories else _Pod(n, view, self.sampled)
                     for n in self.names]
        for pod in self.pods:
            pod.store(self.digests(chunks if pod.name in self.directories else
                                   int(self.rng.binomial(chunks, self.fraction)), pod.name))

    def digests(self, n: int, pod: str) -> list[int]:
        """``n`` fresh random digests: anywhere for a sampled pod, in sampled buckets otherwise."""
        low = self.rng.integers(0, 1 << _SHIFT, size=n, dtype=np.uint64)
        if pod in self.directories:
            high = self.rng.integers(0, 1 << BUCKET_BITS, size=n, dtype=np.uint64)
        else:
            high = self.rng.choice(self.buckets, size=n)
        return ((high << np.uint64(_SHIFT)) | low).tolist()

    def publish(self, pod: _Pod, count: bool = True) -> Traffic:
        """One interval of ``pod``'s messages: sent as JSON, applied by sampled owners, counted."""
        sent = Traffic()
        # Every member hears every other's share in this model: nobody asks for one.
        for owner, batches in pod.publisher.take(pod.view, (), lambda o: True):  # type: ignore[arg-type]
            for batch in batches:
                body = json.dumps(batch.to_dict(), separators=(",", ":")).encode()
                reply = PublishReply(False)
                if owner in self.directories and owner != pod.name:
                    wire = PublishBatch.from_dict(json.loads(body))
                    reply = PublishReply(self.directories[owner].apply(pod.name, wire))
                    if count:
                        t = self.traffic[owner]
                        t.in_bytes += len(body) + self.overhead.request
                        t.out_bytes += len(json.dumps(reply.to_dict())) + self.overhead.response
                        t.in_messages += 1
                        t.records_in += wire.records
                elif owner == pod.name and owner in self.directories:
                    self.directories[owner].apply(owner, batch)
                    continue
                if reply.resync:
                    pod.publisher.needs_reset(owner)
                if owner == pod.name:
                    continue
                if count and (pod.name in self.directories or owner in self.directories):
                    self.contacts.append((self.now, pod.name, owner))
                sent.out_messages += 1
                sent.out_bytes += len(body) + self.overhead.request
                sent.in_bytes += len(json.dumps(reply.to_dict())) + self.overhead.response
        if count and pod.name in self.traffic:
            t = self.traffic[pod.name]
            t.out_bytes += sent.out_bytes
            t.in_bytes += sent.in_bytes
            t.out_messages += sent.out_messages
        return sent

    def step(self, changes: float, refreshes: float, interval: float) -> None:
        """One interval: stores, evictions and tail refreshes, then every pod publishes."""
        for pod in self.pods:
            full = pod.name in self.directories
            n = changes / 2 * interval
            n = int(round(n)) if full else int(self.rng.binomial(int(round(n)), self.fraction))
            pod.store(self.digests(n, pod.name))
            pod.evict(n)
            r = int(round(refreshes * interval)) if full else int(self.rng.binomial(
                int(round(refreshes * interval)), self.fraction))
            for _ in range(min(r, len(pod.fifo))):
                d = pod.fifo[self.py_rng.randrange(len(pod.fifo))]
                pod.publisher.refresh_tail(d, self.py_rng.getrandbits(32))
        for pod in self.pods:
            self.publish(pod)


def sample_pool(pods: int, chunks: int, changes_per_second: float, refreshes_per_second: float, *,
                interval: float, seconds: float, samples: int, overhead: HttpOverhead,
                handshake_bytes: int, seed: int = 0, progress: Progress | None = None) -> SampleFigures:
    """Build the pool, publish its first shares, run ``seconds`` of changes, then a join and a leave."""
    say = progress or (lambda line: None)
    started = time.monotonic()
    samples = max(1, min(samples, pods))
    model = _Model(pods, chunks, samples, overhead, seed)
    say(f"[scale x{pods}] {samples} sampled sidecars hold {chunks} chunks each; {pods - samples} modelled "
        f"hold {model.fraction:.4f} of theirs (the sampled sidecars' buckets)")
    for pod in model.pods:  # everybody's first message: the full share
        model.publish(pod, count=False)
    steps = max(1, int(round(seconds / interval)))
    for i in range(steps):
        model.now = (i + 1) * interval
        model.step(changes_per_second, refreshes_per_second, interval)
        say(f"[scale x{pods}] interval {i + 1}/{steps}")
    span = steps * interval
    memory = {s: (deep_size(model.pods[model.names.index(s)].publisher), deep_size(model.directories[s]))
              for s in model.sampled}
    worst = max(model.sampled, key=lambda s: sum(memory[s]))
    own, directory = memory[worst]
    table = model.table.memory_bytes()
    t = max(model.traffic.values(), key=lambda x: x.in_bytes + x.out_bytes)
    figures = SampleFigures(
        sampled=samples, modelled=pods - samples, location_bytes_per_sidecar=own + directory + table,
        memory_breakdown={"held_digests_and_changes": own, "directory_share": directory, "owner_table": table},
        held_chunks=len(model.pods[model.names.index(worst)].publisher),
        directory_entries=len(model.directories[worst]),
        publish_bytes_out_per_second=t.out_bytes / span, publish_bytes_in_per_second=t.in_bytes / span,
        publish_messages_out_per_second=t.out_messages / span,
        publish_messages_in_per_second=t.in_messages / span)
    figures.control_peers = peers_in_window(model.contacts, CONTROL_KEEPALIVE_SECONDS, only=model.sampled)
    # Steady state: the opens of the first interval (the client filling up) are not counted.
    figures.control_opens_per_second = max(connection_opens(
        [(at, b) for at, a, b in model.contacts if a == s], CONTROL_CONNECTIONS, CONTROL_KEEPALIVE_SECONDS,
        warm_until=interval) for s in model.sampled) / max(span - interval, interval)
    figures.join = _join(model, handshake_bytes)
    figures.leave = _leave(model)
    figures.seconds = time.monotonic() - started
    return figures


def _join(model: _Model, handshake_bytes: int) -> dict[str, float]:
    """A fresh pod joins: what each member sends it, what it receives and sends, how long it took."""
    joiner = "pod-joiner"
    before = {s: model.table.owned_mask(s) for s in model.sampled}
    moved = model.table.add(joiner)
    sent = []
    for s in model.sampled:
        pod = model.pods[model.names.index(s)]
        pod.publisher.owner_joined(joiner)
        records = 0
        traffic = Traffic()
        for owner, batches in pod.publisher.take(model.table):
            for b in batches:
                if owner == joiner:
                    records += b.records
                    traffic.out_bytes += len(json.dumps(b.to_dict(), separators=(",", ":"))) + \
                        model.overhead.request
            if owner != joiner and owner in model.directories:
                for b in batches:
                    model.directories[owner].apply(s, b)
        lost = moved[before[s][moved]]  # its buckets the joiner took: their entries go
        started = time.perf_counter()
        mask = np.zeros(1 << BUCKET_BITS, dtype=bool)
        mask[lost] = True
        model.directories[s].drop_buckets(mask)
        sent.append((records, traffic.out_bytes, time.perf_counter() - started))
    fresh = Publisher(joiner)
    for n in model.names:
        fresh.owner_joined(n)
    own = sum(len(json.dumps(b.to_dict(), separators=(",", ":"))) + model.overhead.request
              for _, batches in fresh.take(model.table) for b in batches)
    pods = len(model.names)
    per_member_records = sum(r for r, _, _ in sent) / len(sent)
    per_member_bytes = sum(b for _, b, _ in sent) / len(sent)
    model.table.remove(joiner)
    return {"buckets_taken": float(len(moved)),
            "bytes_sent_by_each_member": per_member_bytes,
            "entries_sent_by_each_member": per_member_records,
            "joiner_entries_received": per_member_records * pods,
            "joiner_bytes_received": per_member_bytes * pods,
            "joiner_bytes_sent": float(own),
            "handshake_bytes": float(handshake_bytes * 2 * pods),
            "member_drop_seconds": max(t for _, _, t in sent)}


def _leave(model: _Model) -> dict[str, float]:
    """A modelled member leaves: what each sampled member resends, and the purge of its entries."""
    leaver = model.names[-1] if model.names[-1] not in model.directories else model.names[0]
    if leaver in model.directories:
        return {}
    moved = model.table.remove(leaver)
    out = []
    for s in model.sampled:
        pod = model.pods[model.names.index(s)]
        pod.publisher.owner_left(leaver)
        records = pod.publisher.republish(moved.tolist())
        sent = model.publish(pod, count=False)
        started = time.perf_counter()
        purged = model.directories[s].purge(leaver)
        out.append((records, sent.out_bytes, sent.out_messages, purged, time.perf_counter() - started))
    n = len(out)
    return {"buckets_moved": float(len(moved)),
            "entries_resent_by_each_member": sum(o[0] for o in out) / n,
            "bytes_sent_by_each_member": sum(o[1] for o in out) / n,
            "messages_sent_by_each_member": sum(o[2] for o in out) / n,
            "entries_purged_by_each_owner": sum(o[3] for o in out) / n,
            "purge_seconds": max(o[4] for o in out)}
