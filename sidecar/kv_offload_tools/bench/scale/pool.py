"""A pool of sidecars' read paths in one process: the sidecar's own ``Location`` and ``PeerReads``.

Every member is the sidecar's engine-path peer side, unchanged: its real
``Location`` (``OwnerTable``, ``Publisher``, ``Directory``) and its real
``PeerReads`` (owner questions, holder exchanges, the chain from holder to
holder, ``ClaimAudit``, ``FetchOrRecompute``, ``SidecarMetrics``). Only what
lies outside those classes is stood in for here:

- the network: a location message (``publish``, ``locate``) is the owner's
  ``Location.on_publish`` / ``on_locate`` on the JSON body, at once; a holder
  exchange is ``HolderData`` reading the holder's store (a count is its true
  hit prefix; a fetch writes that prefix into the asker's store);
- the store: ``ModelStore``, an LRU of chunk keys with the ChunkStore's order
  rules (a lookup touches the prefix head last, a pin or a send touches a key
  last, a write evicts the least recently used) and its ``on_change`` feeding
  the member's ``Location.record``, as the sidecar wires it.

``serve`` does for one request what the vLLM tier and ``Sidecar`` do (lookup
with fetch, load of the hit prefix, the fetched copies dropped once loaded,
the rest stored) and returns what it cost: messages as the member's own
``kv_offload_lookup_messages_total`` counted them, and as they crossed the
stand-in wire (owner questions, holder exchanges, the holders that served).
All members share one owner table (they all see the same members).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.loop_stalls import LoopStalls
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.claims import ClaimAudit
from kv_offload_sidecar.peers.fetch_cost import FetchOrRecompute, PrefillModel
from kv_offload_sidecar.peers.links import PeerLink
from kv_offload_sidecar.peers.directory.location import Location
from kv_offload_sidecar.peers.directory.ownership import OwnerTable
from kv_offload_sidecar.peers.peer_reads import PeerReads
from prometheus_client import CollectorRegistry

# Seconds a read may take (nothing waits in this process: a bound, never reached).
DEADLINE_SECONDS = 30.0
# Bytes of one chunk as the fetch-cost model sees it (the decision is off: always fetch).
CHUNK_BYTES = 4096
# Tokens of one chunk (the Mooncake block).
TOKENS_PER_CHUNK = 512


class ModelStore:
    """An LRU of chunk keys that reports every change (the ChunkStore's ``on_change``)."""

    slot_bytes = CHUNK_BYTES

    def __init__(self, capacity: int, on_change: Callable[[bytes, bool], None]) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.on_change = on_change
        # Keys ever written (the background writes top this up to the store's turnover).
        self.inserted = 0
        # Writes and evictions (store changes) so far.
        self.changes = 0

    def contains(self, key: bytes) -> bool:
        return key in self.keys

    def prefix(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` held; touches nothing (a peer's count)."""
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` held, touched back to front (the head ends most recent)."""
        n = self.prefix(keys)
        for k in reversed(keys[:n]):
            self.keys.move_to_end(k)
        return n

    def pin_prefix(self, keys: Sequence[bytes]) -> int:
        """Pin the leading held ``keys`` one by one (each pin touches its key); how many."""
        n = self.prefix(keys)
        for k in keys[:n]:
            self.keys.move_to_end(k)
        return n

    def put(self, keys: Sequence[bytes]) -> int:
        """Write ``keys`` (held ones skipped), evicting the least recently used; the leading
        ``keys`` held afterwards."""
        for k in keys:
            if k in self.keys:
                continue
            while len(self.keys) >= self.capacity:
                old, _ = self.keys.popitem(last=False)
                self.changes += 1
                self.on_change(old, False)
            self.keys[k] = None
            self.inserted += 1
            self.changes += 1
            self.on_change(k, True)
        return self.prefix(keys)

    def drop(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` (peers' chunks once loaded: ``drop_when_released``)."""
        for k in keys:
            if k in self.keys:
                del self.keys[k]
                self.changes += 1
                self.on_change(k, False)


@dataclass
class Wire:
    """The messages of the request being served, as they crossed the stand-in wire."""

    # Owner questions (POST /v1/locate) and holder exchanges (counts, fetches).
    owner_questions: int = 0
    holder_exchanges: int = 0
    # Exchanges whose holder had not the first key asked (a false claim).
    false_exchanges: int = 0
    # Holders that served chunks, in the order read (one entry per run).
    holders: list[str] = field(default_factory=list)
    # JSON body bytes of the owner questions and their replies.
    locate_query_bytes: int = 0
    locate_reply_bytes: int = 0
    # The member serving the request, and the replay's clock (seconds) at its start.
    asker: str = ""
    now: float = 0.0
    # Every holder exchange and every location message: (seconds, from, to) (``links``).
    data_contacts: list[tuple[float, str, str]] = field(default_factory=list)
    control_contacts: list[tuple[float, str, str]] = field(default_factory=list)

    def reset(self) -> None:
        """A new request: its own counts (the byte totals run on)."""
        self.owner_questions = self.holder_exchanges = self.false_exchanges = 0
        self.holders.clear()


class HolderData:
    """A holder's data plane as its askers' ``PeerLink.data``: its store read at once."""

    closed = False

    def __init__(self, identity: str, store: ModelStore, wire: Wire) -> None:
        self.identity = identity
        self.store = store
        self.wire = wire

    @property
    def heard_at(self) -> float:
        """When the holder was last heard from: now (it answers in process, never silent)."""
        return time.monotonic()

    def _count(self, keys: Sequence[bytes]) -> int:
        self.wire.holder_exchanges += 1
        self.wire.data_contacts.append((self.wire.now, self.wire.asker, self.identity))
        n = self.store.prefix(keys)
        self.wire.false_exchanges += n == 0
        return n

    def _send(self, keys: Sequence[bytes], into: ModelStore) -> int:
        if keys:
            self.wire.holders.append(self.identity)
        self.store.pin_prefix(keys)  # each send pins its chunk
        return into.put(keys)

    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        return self._count(keys)

    async def fetch(self, keys: Sequence[bytes], store: ModelStore, timeout: float) -> int:
        return self._send(keys[:self._count(keys)], store)

    async def fetch_counted(self, keys: Sequence[bytes], store: ModelStore, timeout: float, *,
                            first: int, on_count: Callable[[int], None]) -> int:
        n = self._count(keys)
        on_count(n)
        return self._send(keys[:n], store)


class OpenLinks:
    """``PeerManager.data_links`` as ``PeerReads`` sees it: every holder's data open at once
    (the links a member would hold are counted from ``Wire.data_contacts``)."""

    @contextlib.asynccontextmanager
    async def acquire(self, link: PeerLink, deadline: float) -> AsyncIterator[Any]:
        yield link.data


class Peers:
    """``PeerManager`` as ``PeerReads`` sees it: every member connected."""

    def __init__(self) -> None:
        self.links: dict[str, PeerLink] = {}
        self.data_links = OpenLinks()

    def connected(self, identity: str) -> PeerLink | None:
        return self.links.get(identity)

    def report_failure(self, link: PeerLink, error: str) -> None:
        raise AssertionError(f"{link.identity} failed in process: {error}")


@dataclass(frozen=True)
class Served:
    """What one request got and cost."""

    # Chunks held locally, and brought from peers.
    local: int
    peer: int
    # Messages counted by the member's kv_offload_lookup_messages_total.
    messages: int
    # Owner questions and holder exchanges that crossed the wire.
    owner_questions: int
    holder_exchanges: int
    # Holder exchanges that found nothing (false claims).
    false_exchanges: int
    # Holders read in turn that served chunks (a holder of two runs of the prefix counts twice).
    holders: int
    # Store changes (writes and evictions) the request caused at its member.
    changes: int


class Member:
    """One sidecar's read path: its Location, PeerReads, metrics and store."""

    def __init__(self, name: str, table: OwnerTable, capacity: int, call: Any, peers: Peers,
                 clock: Callable[[], float]) -> None:
        self.name = name
        self.location = Location(name, interval_seconds=1.0, deadline_seconds=DEADLINE_SECONDS, call=call)
        shared = copy.copy(table)  # the pool's table (same members everywhere), this member's identity
        shared.identity = name
        self.location.table = shared
        self.metrics = SidecarMetrics(CollectorRegistry())
        self.store = ModelStore(capacity, self.location.record)
        self.reads = PeerReads(location=self.location, peers=peers, claims=ClaimAudit(clock=clock),  # type: ignore[arg-type]
                               metrics=self.metrics, store=lambda: self.store,
                               deadline_seconds=DEADLINE_SECONDS,
                               cost=FetchOrRecompute(PrefillModel(0.0, TOKENS_PER_CHUNK, CHUNK_BYTES)),
                               stalls=LoopStalls())  # never run: the model's loop does not stall

    def messages(self) -> int:
        """The member's kv_offload_lookup_messages_total."""
        family, = self.metrics.lookup_messages.collect()
        return int(next(s.value for s in family.samples if s.name.endswith("_total")))


class DirectoryPool:
    """``pods`` members reading from each other through the chunk directory."""

    def __init__(self, pods: int, capacity: int, clock: Callable[[], float]) -> None:
        self.names = [f"pod-{i}" for i in range(pods)]
        self.wire = Wire()
        self.clock = clock
        table = OwnerTable(self.names[0])
        for n in self.names[1:]:
            table.add(n)
        peers = Peers()
        self.members = [Member(n, table, capacity, self._caller(n), peers, clock) for n in self.names]
        self.by_name = {m.name: m for m in self.members}
        peers.links.update((m.name, PeerLink(address=m.name, state="connected", identity=m.name,
                                             data=HolderData(m.name, m.store, self.wire))) for m in self.members)

    @property
    def stores(self) -> list[ModelStore]:
        return [m.store for m in self.members]

    def _caller(self, sender: str) -> Any:
        async def call(peer: str, op: str, body: dict[str, Any], timeout: float) -> Any:
            owner = self.by_name[peer].location
            wire = json.loads(json.dumps(body, separators=(",", ":")))
            self.wire.control_contacts.append((self.clock(), sender, peer))
            if op == "publish":
                return owner.on_publish(sender, wire)
            reply = owner.on_locate(sender, wire)
            self.wire.owner_questions += 1
            self.wire.locate_query_bytes += len(json.dumps(body, separators=(",", ":")))
            self.wire.locate_reply_bytes += len(json.dumps(reply, separators=(",", ":")))
            return reply
        return call

    async def publish(self) -> None:
        """One publish interval: every member hands its messages to their owners, delivered."""
        for m in self.members:
            m.location.publish_once()
        here = asyncio.current_task()
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not here))

    async def serve(self, i: int, keys: list[bytes]) -> Served:
        """Request ``keys`` at member ``i``: what the tier and the sidecar do, and its cost."""
        m = self.members[i]
        w = self.wire
        w.reset()
        w.asker, w.now = m.name, self.clock()
        before, changes = m.messages(), m.store.changes
        local = m.store.lookup_prefix(keys)  # Sidecar.lookup
        m.location.hint_chain(keys, held=local > 0)
        peer = await m.reads.lookup(keys, local, DEADLINE_SECONDS, fetch=True) if local < len(keys) else 0
        hits = keys[:local + peer]  # the tier loads the hit prefix (Sidecar.load)
        loaded = m.store.pin_prefix(hits)
        if loaded < len(hits):
            await m.reads.load(hits, loaded, DEADLINE_SECONDS)
            loaded = m.store.pin_prefix(hits)
        m.store.drop(m.reads.take_fetched(hits))  # --peer-copies drop: the holders keep them
        rest = keys[loaded:]  # the tier stores what the engine computed (Sidecar.reserve)
        m.location.hint_chain(rest)
        m.store.put(rest)
        return Served(local=local, peer=loaded - local, messages=m.messages() - before,
                      owner_questions=w.owner_questions, holder_exchanges=w.holder_exchanges,
                      false_exchanges=w.false_exchanges,
                      holders=len(w.holders), changes=m.store.changes - changes)
