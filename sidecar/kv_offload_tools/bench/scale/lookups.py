"""Lookups through the chunk directory against the exact scheme, on one request stream.

``replay_lookups`` serves a stream of requests ((seconds, chunk keys), in
time order), each routed to a member (at random, or round-robin), with one
of two schemes, and counts what every request got and cost:

- ``directory``: the sidecar's own read (``scale_pool.DirectoryPool``: every
  member's real ``Location`` and ``PeerReads``). A request whose prefix lies on
  several holders (a conversation whose turns ran on different pods, each
  storing what it computed, fetchers keeping no copy) is read from holder to
  holder as the sidecar reads it: an owner question (none when the member owns
  the key) and a holder exchange per holder, then an owner question for the
  first key nobody holds. Messages are those the members' own
  ``kv_offload_lookup_messages_total`` counted.
- ``exact``: the previous design. Every member knows, as of the last interval,
  every other member's exact set, and reads the same chain from the member
  with the longest run at each step: a lookup, then a fetch, per holder.

Both keep the same store rules (``scale_pool.ModelStore``: fetched chunks
dropped once loaded, the rest stored). Every ``interval`` the members publish
(directory: ``Location.publish_once``, delivered) or every summary is pulled
(exact). With ``lifetime_seconds``, background writes top each store's own
writes up so that its chunks live that long, as long as a ``chunks_per_pod``
store lives at ``changes_per_second`` (half of them stores): chains age and
owners' views go stale as they would at full size.

With the directory, every holder exchange and location message is a contact between two
members (``links``): the distinct peers each exchanged chunks with within
``DATA_IDLE_SECONDS`` (its data links) and messaged within ``CONTROL_KEEPALIVE_SECONDS``.

Each request with peer hits is counted by the number of holders read in turn
that served it (``by_holders``; a holder of two runs of the prefix counts
twice): how the messages grow with holders per prefix. A read over k holders
costs at most 2k + 1 messages, plus one per false exchange.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.peers.control_client import CONTROL_KEEPALIVE_SECONDS
from kv_offload_sidecar.peers.data_links import DATA_IDLE_SECONDS
from kv_offload_sidecar.peers.peer_reads import MAX_HOLDERS

from kv_offload_tools.bench.scale.links import peers_in_window
from kv_offload_tools.bench.scale.pool import DirectoryPool, ModelStore, Served

Progress = Callable[[str], None]
SCHEMES = ("directory", "exact")
ROUTINGS = ("random", "round-robin")


def _per(numerator: str, denominator: str) -> property:
    """A read-only figure: field ``numerator`` over field ``denominator`` (0.0 while that is 0)."""
    def ratio(self: Any) -> float:
        whole = getattr(self, denominator)
        return getattr(self, numerator) / whole if whole else 0.0
    return property(ratio)


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
    # Messages to peers: owner questions (locates) and holder exchanges.
    messages: int = 0
    # Of those, owner questions.
    locate_messages: int = 0
    # Messages of the requests that got peer hits.
    peer_hit_request_messages: int = 0
    # Exchanges with a holder, and those whose holder had not the first key (false positives).
    holder_exchanges: int = 0
    false_positive_exchanges: int = 0
    # JSON body bytes of the owner questions and of their replies.
    locate_query_bytes: int = 0
    locate_reply_bytes: int = 0
    # Store changes (writes + evictions) the requests caused.
    request_changes: int = 0
    # Requests with peer hits by holders read: {holders: [requests, messages, false exchanges]}.
    by_holders: dict[int, list[int]] = field(default_factory=dict)
    # Distinct peers a member exchanged chunks with within an idle window, and messaged within
    # a keep-alive (directory scheme; ``scale_links.peers_in_window``: max, mean, members).
    data_peers: dict[str, float] = field(default_factory=dict)
    # The same, counted at the asker only (holders it read from: its own data links, bounded)
    # and at the holder only (askers reading from it: connections its server holds).
    data_peers_read_from: dict[str, float] = field(default_factory=dict)
    data_peers_reading: dict[str, float] = field(default_factory=dict)
    control_peers: dict[str, float] = field(default_factory=dict)
    # Wall-clock seconds of the replay.
    seconds: float = 0.0

    hit_ratio = _per("hits", "chunks")
    messages_per_lookup = _per("messages", "requests")
    # Messages of the requests with peer hits, per such request.
    messages_per_peer_hit_request = _per("peer_hit_request_messages", "peer_hit_requests")
    # Every message, per request with peer hits (``bench replay``'s figure).
    all_messages_per_peer_hit_request = _per("messages", "peer_hit_requests")
    false_positive_ratio = _per("false_positive_exchanges", "holder_exchanges")
    changes_per_request = _per("request_changes", "requests")

    def holders_view(self) -> dict[str, dict[str, float]]:
        """Per number of holders read: share of the peer-hit requests, messages and false
        exchanges per request."""
        return {str(k): {"requests": n, "share": n / self.peer_hit_requests, "messages_per_request": m / n,
                         "false_exchanges_per_request": x / n}
                for k, (n, m, x) in sorted(self.by_holders.items())}

    def add(self, keys: Sequence[bytes], s: Served) -> None:
        self.requests += 1
        self.chunks += len(keys)
        self.hits += s.local + s.peer
        self.local_hits += s.local
        self.peer_hits += s.peer
        self.messages += s.messages
        self.locate_messages += s.owner_questions
        self.holder_exchanges += s.holder_exchanges
        self.false_positive_exchanges += s.false_exchanges
        self.request_changes += s.changes
        if s.peer:
            self.peer_hit_requests += 1
            self.peer_hit_request_messages += s.messages
            row = self.by_holders.setdefault(s.holders, [0, 0, 0])
            row[0] += 1
            row[1] += s.messages
            row[2] += s.false_exchanges


class ExactPool:
    """The previous design: every member's exact set as of the last pull; read holder by holder."""

    def __init__(self, pods: int, capacity: int) -> None:
        self.changes: list[list[tuple[bytes, bool]]] = [[] for _ in range(pods)]
        self.stores = [ModelStore(capacity, self._observer(i)) for i in range(pods)]
        self.snapshot: dict[bytes, set[int]] = {}

    def _observer(self, i: int) -> Callable[[bytes, bool], None]:
        log = self.changes[i]
        return lambda key, present: log.append((key, present))

    async def publish(self) -> None:
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

    async def serve(self, i: int, keys: list[bytes]) -> Served:
        store = self.stores[i]
        changes = store.changes
        local = store.lookup_prefix(keys)
        rest, fetched, holders, messages, exchanges, false = keys[local:], [], 0, 0, 0, 0
        for _ in range(MAX_HOLDERS):
            h = self._choose(i, rest)
            if h is None:
                break
            n = self.stores[h].prefix(rest)
            exchanges += 1
            messages += 1 + (n > 0)  # a lookup, then a fetch
            if n == 0:
                false += 1
                break
            holders += 1
            self.stores[h].pin_prefix(rest[:n])
            store.put(rest[:n])
            fetched += rest[:n]
            while n < len(rest) and store.contains(rest[n]):
                n += 1
            rest = rest[n:]
        hits = keys[:len(keys) - len(rest)]
        loaded = store.pin_prefix(hits)
        store.drop(fetched)
        store.put(keys[loaded:])
        return Served(local=local, peer=loaded - local, messages=messages, owner_questions=0,
                      holder_exchanges=exchanges, false_exchanges=false, holders=holders,
                      changes=store.changes - changes)

    def _choose(self, i: int, rest: list[bytes]) -> int | None:
        best, best_n = None, 0
        for h in self.snapshot.get(rest[0], ()) if rest else ():
            if h == i:
                continue
            n = 0
            while n < len(rest) and h in self.snapshot.get(rest[n], ()):
                n += 1
            if n > best_n or (n == best_n and best is not None and h < best):
                best, best_n = h, n
        return best


def replay_lookups(scheme: str, pods: int, requests: Sequence[tuple[float, list[bytes]]], *,
                   capacity: int, interval: float, lifetime_seconds: float | None = None,
                   routing: str = "random", seed: int = 0, progress: Progress | None = None) -> LookupFigures:
    """Replay ``requests`` ((seconds, keys), in time order) over ``pods`` members with ``scheme``;
    routing and background writes are the same for both schemes."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {SCHEMES}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not one of {ROUTINGS}")
    return asyncio.run(_replay(scheme, pods, requests, capacity, interval, lifetime_seconds, routing, seed,
                               progress))


async def _replay(scheme: str, pods: int, requests: Sequence[tuple[float, list[bytes]]], capacity: int,
                  interval: float, lifetime: float | None, routing: str, seed: int,
                  progress: Progress | None) -> LookupFigures:
    started = time.monotonic()
    now = [0.0]
    pool: DirectoryPool | ExactPool = (DirectoryPool(pods, capacity, lambda: now[0]) if scheme == "directory"
                                       else ExactPool(pods, capacity))
    fig = LookupFigures(scheme)
    route = random.Random(seed)
    filler = random.Random(seed + 1)
    owed = [0.0] * pods
    seen = [0] * pods
    per_tick = capacity / lifetime * interval if lifetime else 0.0
    next_tick = interval
    last = time.monotonic()
    for r, (at, keys) in enumerate(requests):
        while at >= next_tick:
            now[0] = next_tick
            for i, store in enumerate(pool.stores if per_tick else ()):  # top the store's own writes up
                owed[i] = max(-per_tick, owed[i] + per_tick - (store.inserted - seen[i]))
                n = int(owed[i])
                if n > 0:
                    owed[i] -= n
                    store.put([filler.getrandbits(160).to_bytes(20, "big") for _ in range(n)])
                seen[i] = store.inserted
            await pool.publish()
            next_tick += interval
        now[0] = at
        served = await pool.serve(route.randrange(pods) if routing == "random" else r % pods, keys)
        fig.add(keys, served)
        if progress and time.monotonic() - last > 5.0:
            last = time.monotonic()
            progress(f"[scale x{pods}] {scheme} replay {r + 1}/{len(requests)} requests")
    if isinstance(pool, DirectoryPool):
        fig.locate_query_bytes = pool.wire.locate_query_bytes
        fig.locate_reply_bytes = pool.wire.locate_reply_bytes
        fig.data_peers = peers_in_window(pool.wire.data_contacts, DATA_IDLE_SECONDS)
        fig.data_peers_read_from = peers_in_window(pool.wire.data_contacts, DATA_IDLE_SECONDS, ends="from")
        fig.data_peers_reading = peers_in_window(pool.wire.data_contacts, DATA_IDLE_SECONDS, ends="to")
        fig.control_peers = peers_in_window(pool.wire.control_contacts, CONTROL_KEEPALIVE_SECONDS)
    fig.seconds = time.monotonic() - started
    return fig
