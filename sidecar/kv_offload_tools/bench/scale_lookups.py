"""Lookups through the chunk directory against the exact scheme, on one request stream.

Every member of the pool runs here: its store (an LRU of ``capacity`` chunks
that touches a used prefix head last, pins what it sends and demotes what it
fetched, as the sidecar's ChunkStore does), its real
``Publisher`` fed by the store's changes and the engine path's chain hints,
and its real ``Directory``. Requests (generated chat conversations, routed
to random pods) do what a sidecar does for the vLLM tier: the local prefix,
then one locate at the owner of the first missing key (no message when that
is the pod itself), then one exchange with the first holder named (its answer
is its store's true prefix: a holder that no longer has the key makes a
false-positive lookup), then the misses are stored. Every ``interval`` the
members publish (bodies through JSON, as on the wire). Background writes top
each store's own writes up so that its chunks live ``lifetime`` seconds, as
long as a ``chunks_per_pod`` store lives at ``changes_per_second`` (half of
them stores): chains age and owners' views go stale as they would at full size.

The exact scheme replays the same stream: every member knows, as of the last
interval, every other member's exact set (the summaries of the previous
design) and asks the member with the longest run; a lookup then a fetch.
"""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_offload_sidecar.peers.directory import Directory
from kv_offload_sidecar.peers.location_wire import (
    MAX_LOCATE_DIGESTS,
    LocateQuery,
    LocateReply,
    PublishBatch,
    key_digest,
)
from kv_offload_sidecar.peers.ownership import OwnerTable
from kv_offload_sidecar.peers.publisher import Publisher

Progress = Callable[[str], None]


@dataclass
class LookupFigures:
    """One scheme's replay of the stream."""

    # "directory" or "exact".
    scheme: str
    # Requests replayed, and chunk keys in them.
    requests: int = 0
    chunks: int = 0
    # Chunks hit: all, held locally, brought from a peer.
    hits: int = 0
    local_hits: int = 0
    peer_hits: int = 0
    # Requests that got at least one chunk from a peer.
    peer_hit_requests: int = 0
    # Messages to peers: owner queries (locates) and holder exchanges (lookups, fetches).
    messages: int = 0
    # Of those, owner queries.
    locate_messages: int = 0
    # Messages of the requests that got peer hits.
    peer_hit_request_messages: int = 0
    # Exchanges with a holder, and those whose holder had not the first key (false positives).
    holder_exchanges: int = 0
    false_positive_exchanges: int = 0
    # JSON body bytes of the owner queries and of their replies.
    locate_query_bytes: int = 0
    locate_reply_bytes: int = 0
    # Store changes (stores + evictions) the requests caused.
    request_changes: int = 0
    # Wall-clock seconds of the replay.
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.chunks if self.chunks else 0.0

    @property
    def messages_per_lookup(self) -> float:
        return self.messages / self.requests if self.requests else 0.0

    @property
    def messages_per_peer_hit_request(self) -> float:
        return self.peer_hit_request_messages / self.peer_hit_requests if self.peer_hit_requests else 0.0

    @property
    def false_positive_ratio(self) -> float:
        return self.false_positive_exchanges / self.holder_exchanges if self.holder_exchanges else 0.0

    @property
    def changes_per_request(self) -> float:
        return self.request_changes / self.requests if self.requests else 0.0


class _Store:
    """An LRU of chunk keys that reports every change (the ChunkStore's on_change)."""

    def __init__(self, capacity: int, on_change: Callable[[bytes, bool], None]) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.on_change = on_change
        self.inserted = 0

    def prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark a held prefix used, back to front (its head ends most recent, as ChunkStore does)."""
        for k in reversed(keys):
            self.keys.move_to_end(k)

    def serve(self, keys: Sequence[bytes]) -> None:
        """A peer read ``keys``: its lookup marks them used head last, then each send pins one."""
        self.touch(keys)
        for k in keys:
            self.keys.move_to_end(k)

    def put(self, keys: Sequence[bytes], *, cold: bool = False) -> int:
        """Store ``keys`` (then demote them with ``cold``: peer copies, the last one coldest, as
        the sidecar does once a load pinned them); returns the changes made."""
        changes = 0
        for k in keys:
            if k in self.keys:
                continue
            while len(self.keys) >= self.capacity:
                old, _ = self.keys.popitem(last=False)
                self.on_change(old, False)
                changes += 1
            self.keys[k] = None
            self.on_change(k, True)
            changes += 1
            self.inserted += 1
        if cold:
            for k in keys:
                if k in self.keys:
                    self.keys.move_to_end(k, last=False)
        return changes


class _Pool:
    """The members of one replay and the scheme they locate chunks with."""

    def __init__(self, scheme: str, pods: int, capacity: int) -> None:
        self.scheme = scheme
        self.names = [f"pod-{i}" for i in range(pods)]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.table = OwnerTable(self.names[0])
        for n in self.names[1:]:
            self.table.add(n)
        self.publishers = [Publisher(n) for n in self.names]
        self.directories = {n: Directory() for n in self.names}
        self.changes: list[list[tuple[bytes, bool]]] = [[] for _ in self.names]
        self.snapshot: dict[bytes, set[int]] = {}
        self.stores = [_Store(capacity, self._observer(i)) for i in range(pods)]
        self.publish_bytes = 0
        self.publish_messages = 0

    def _observer(self, i: int) -> Callable[[bytes, bool], None]:
        if self.scheme == "directory":
            return self.publishers[i].record
        log = self.changes[i]
        return lambda key, present: log.append((key, present))

    def tick(self) -> None:
        """One interval: members publish (directory) or every member's summary is pulled (exact)."""
        if self.scheme == "exact":
            for i, log in enumerate(self.changes):
                for key, present in log:
                    holders = self.snapshot.setdefault(key, set())
                    if present:
                        holders.add(i)
                    else:
                        holders.discard(i)
                        if not holders:
                            del self.snapshot[key]
                log.clear()
            return
        for name, pub in zip(self.names, self.publishers):
            if not pub.pending():
                continue
            for owner, batches in pub.take(self.table, (), lambda o: True):
                for batch in batches:
                    if owner == name:
                        self.directories[owner].apply(name, batch)
                        continue
                    body = json.dumps(batch.to_dict(), separators=(",", ":"))
                    self.publish_bytes += len(body)
                    self.publish_messages += 1
                    if self.directories[owner].apply(name, PublishBatch.from_dict(json.loads(body))):
                        pub.needs_reset(owner)

    def serve(self, i: int, keys: list[bytes], fig: LookupFigures) -> None:
        store = self.stores[i]
        local = store.prefix(keys)
        store.touch(keys[:local])
        if self.scheme == "directory":
            self.publishers[i].hint_chain(keys, held=local > 0)
        rest = keys[local:]
        count = messages = 0
        if rest:
            holder, messages = (self._locate if self.scheme == "directory" else self._choose)(i, rest, fig)
            if holder is not None:
                fig.holder_exchanges += 1
                count = self.stores[holder].prefix(rest)
                fig.false_positive_exchanges += count == 0
                self.stores[holder].serve(rest[:count])
                messages += 1 + (self.scheme == "exact" and count > 0)  # exact: a lookup, then a fetch
        if self.scheme == "directory":
            self.publishers[i].mark_copies(rest[:count])  # the fetch
            if rest[count:]:
                self.publishers[i].hint_chain(rest[count:])  # the store's reservation
        fig.request_changes += store.put(rest[:count], cold=True) + store.put(rest[count:])
        fig.requests += 1
        fig.chunks += len(keys)
        fig.hits += local + count
        fig.local_hits += local
        fig.peer_hits += count
        fig.messages += messages
        if count:
            fig.peer_hit_requests += 1
            fig.peer_hit_request_messages += messages

    def _locate(self, i: int, rest: list[bytes], fig: LookupFigures) -> tuple[int | None, int]:
        digests = tuple(key_digest(k) for k in rest[:MAX_LOCATE_DIGESTS])
        owner = self.table.owner_of(digests[0])
        name = self.names[i]
        holders = self.directories[owner].locate(digests, exclude=name)
        messages = 0
        if owner != name:
            messages = 1
            fig.locate_messages += 1
            fig.locate_query_bytes += len(json.dumps(LocateQuery(digests).to_dict(), separators=(",", ":")))
            fig.locate_reply_bytes += len(json.dumps(LocateReply(holders).to_dict(), separators=(",", ":")))
        for h in holders:
            if h.identity != name:
                return self.index[h.identity], messages
        return None, messages

    def _choose(self, i: int, rest: list[bytes], fig: LookupFigures) -> tuple[int | None, int]:
        best, best_n = None, 0
        for h in self.snapshot.get(rest[0], ()):
            if h == i:
                continue
            n = 0
            while n < len(rest) and h in self.snapshot.get(rest[n], ()):
                n += 1
            if n > best_n or (n == best_n and best is not None and h < best):
                best, best_n = h, n
        return best, 0

    def filler(self, i: int, n: int, rng: random.Random) -> None:
        self.stores[i].put([rng.getrandbits(160).to_bytes(20, "big") for _ in range(n)])


def replay_lookups(scheme: str, pods: int, requests: Sequence[tuple[float, list[bytes]]], *,
                   capacity: int, interval: float, lifetime_seconds: float, seed: int = 0,
                   progress: Progress | None = None) -> LookupFigures:
    """Replay ``requests`` ((seconds, keys), in time order) over ``pods`` members with ``scheme``
    ("directory" or "exact"); routing and background writes are the same for both schemes."""
    started = time.monotonic()
    pool = _Pool(scheme, pods, capacity)
    fig = LookupFigures(scheme)
    route = random.Random(seed)
    filler = random.Random(seed + 1)
    owed = [0.0] * pods
    seen = [0] * pods
    per_tick = capacity / lifetime_seconds * interval
    next_tick = interval
    last = time.monotonic()
    for r, (at, keys) in enumerate(requests):
        while at >= next_tick:
            for i, store in enumerate(pool.stores):  # background writes top the store's own up
                owed[i] = max(-per_tick, owed[i] + per_tick - (store.inserted - seen[i]))
                n = int(owed[i])
                if n > 0:
                    owed[i] -= n
                    pool.filler(i, n, filler)
                seen[i] = store.inserted
            pool.tick()
            next_tick += interval
        pool.serve(route.randrange(pods), keys, fig)
        if progress and time.monotonic() - last > 5.0:
            last = time.monotonic()
            progress(f"[scale x{pods}] {scheme} replay {r + 1}/{len(requests)} requests")
    fig.seconds = time.monotonic() - started
    return fig
