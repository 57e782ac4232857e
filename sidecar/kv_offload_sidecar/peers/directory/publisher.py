"""The holder's side of the chunk directory: what this sidecar holds, and what owners must hear.

The store reports every chunk that becomes visible or goes (``record``, its
``on_change``). The publisher keeps the set of digests held and the net
changes since the last publish; at each publish interval ``take`` groups the
changes by owner (``ownership.OwnerTable``: each digest goes to every owner of its
bucket) into ``PublishBatch`` messages, one stream per owner numbered by ``seq``. An owner that is new to this
sidecar's view, that asked for a resync, or whose last message failed gets
the full share instead (``reset``: every held digest in its buckets). When
members leave, ``republish`` sends the digests of their buckets to the
buckets' new owners. When a member joins, the members it pushes out of some
buckets' owners are sent removes of what we hold there (``retract``): they drop
those buckets themselves when they see the join, but a change of ours may reach
them after that (they saw the join first, or it was in flight), and that entry
would stay there for ever. So a membership change moves only the share it
changes, and once every member sees the same members, every owner keeps exactly
what the holders hold in its buckets.

Tails. Every add carries a 4-byte tail: the last key of the chain the chunk
came in (a store batch, a fetched run; ``hint_chain``), or of a later chain
through it (a lookup whose first key is held is republished at the next
interval with that lookup's last key). Chunks fetched from a peer
(``mark_copies``: the store demotes them, so they go first) are published as
copies until a lookup uses them here. Owners rank holders by both.

Thread-safe: the store calls ``record`` from any thread.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_offload_sidecar.peers.directory.location_wire import (
    MAX_PUBLISH_RECORDS,
    PublishBatch,
    key_digest,
    tail_of,
)
from kv_offload_sidecar.peers.directory.ownership import BUCKET_BITS, OwnerTable

# Pending change value meaning "no longer held".
REMOVED = -1
# Tail hints kept for chunks being written or fetched (oldest dropped first).
MAX_TAIL_HINTS = 65536
# Chains (lookups) remembered between two publishes (oldest dropped first).
MAX_CHAIN_HINTS = 4096
# Unpublished changes kept; past this the owners get full shares (reset) instead.
MAX_PENDING = 1 << 20
# Flag of a pending or held value: the chunk is a copy fetched from a peer.
COPY = 1 << 32
# Chunks being fetched, remembered until they arrive (oldest forgotten first).
MAX_COPY_HINTS = 65536


@dataclass
class _Stream:
    """This sidecar's message stream to one owner."""

    # seq of the last message handed out for this owner.
    seq: int = 0
    # The next message must be a reset (the owner lacks or lost our state).
    reset: bool = True
    # Publish round from which on to ask the owner for its full share while we hold none of it
    # (-1: not asking). Two rounds after a join: in a join both sides send their share anyway.
    ask_from: int = -1


class Publisher:
    """Held digests, net changes per digest, and one publish stream per owner."""

    def __init__(self, identity: str, *, epoch: str | None = None) -> None:
        # This sidecar's identity (owner of the buckets it keeps itself).
        self.identity = identity
        # Lifetime of this publisher; owners drop what they had from an older epoch.
        self.epoch = epoch or secrets.token_hex(8)
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # digest held -> the tail it was last published with
        self._dups: dict[int, int] = {}  # digest -> extra keys with it (a 64-bit collision)
        self._pending: dict[int, int] = {}  # digest -> tail to publish, or REMOVED
        self._fresh: set[int] = set()  # pending adds the owner has not heard of at all (a remove nets out)
        self._tails: OrderedDict[int, int] = OrderedDict()  # digest -> tail of its chain
        self._copies: OrderedDict[int, None] = OrderedDict()  # digests being fetched from peers
        self._chains: OrderedDict[int, int] = OrderedDict()  # first digest -> tail of a chain through it
        self._streams: dict[str, _Stream] = {}
        self._due: set[str] = set()  # owners whose stream owes a reset or a request for their share
        self._overflow = False
        self._round = 0
        self._retract: dict[str, set[int]] = {}  # owner -> buckets it no longer owns (send removes)

    # ---- fed by the store and the engine path -----------------------------------------------

    def record(self, key: bytes, present: bool) -> None:
        """Store callback: ``key`` became visible (True) or went away (False)."""
        self.record_digest(key_digest(key), present)

    def record_digest(self, d: int, present: bool) -> None:
        with self._lock:
            if present:
                if d in self._held:
                    self._dups[d] = self._dups.get(d, 0) + 1
                    return
                tail = self._tails.pop(d, None)
                tail = tail_of(d) if tail is None else tail
                if d in self._copies:
                    del self._copies[d]
                    tail |= COPY
                self._held[d] = tail
                fresh = self._pending.get(d) != REMOVED  # else the owner still has it
                self._change(d, tail)
                if fresh:
                    self._fresh.add(d)
            else:
                extra = self._dups.get(d)
                if extra:
                    self._dups[d] = extra - 1
                    if extra == 1:
                        del self._dups[d]
                    return
                if d not in self._held:
                    return
                del self._held[d]
                if d in self._fresh:  # added and removed before anyone heard: nothing to say
                    self._fresh.discard(d)
                    self._pending.pop(d, None)
                    return
                self._change(d, REMOVED)

    def hint_chain(self, keys: Sequence[bytes], *, held: bool = False) -> None:
        """``keys`` are consecutive keys of one request: those not held yet take the last one's
        tail when they arrive; with ``held``, the first key is republished with that tail."""
        if not keys:
            return
        digests = [key_digest(k) for k in keys]
        tail = tail_of(digests[-1])
        with self._lock:
            if held:
                self._chain(digests[0], tail)
            for d in digests:
                if d not in self._held:
                    self._tails[d] = tail
                    self._tails.move_to_end(d)
            while len(self._tails) > MAX_TAIL_HINTS:
                self._tails.popitem(last=False)

    def mark_copies(self, keys: Sequence[bytes]) -> None:
        """``keys`` are being fetched from a peer: published as copies when they arrive."""
        with self._lock:
            for k in keys:
                d = key_digest(k)
                if d not in self._held:
                    self._copies[d] = None
                    self._copies.move_to_end(d)
            while len(self._copies) > MAX_COPY_HINTS:
                self._copies.popitem(last=False)

    def refresh_tail(self, d: int, tail: int) -> None:
        """A chain through the held digest ``d`` ends at ``tail`` now: republish ``d`` with it."""
        with self._lock:
            self._chain(d, tail)

    def _chain(self, d: int, tail: int) -> None:
        self._chains[d] = tail
        self._chains.move_to_end(d)
        while len(self._chains) > MAX_CHAIN_HINTS:
            self._chains.popitem(last=False)

    def _change(self, d: int, value: int) -> None:
        if len(self._pending) >= MAX_PENDING and d not in self._pending:
            self._overflow = True  # too far behind: every owner gets its full share instead
            self._pending.clear()
            self._fresh.clear()
            return
        self._pending[d] = value

    # ---- views ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, d: int) -> bool:
        return d in self._held

    def pending(self) -> int:
        """Changes not yet handed out, plus owners owed their full share or a request for ours."""
        with self._lock:
            return len(self._pending) + len(self._chains) + len(self._due) + len(self._retract)

    # ---- membership and replies ------------------------------------------------------------

    def owner_joined(self, owner: str, *, resync_me: bool = False) -> None:
        """A member entered the view: its next message is its full share (a reset); with
        ``resync_me`` (we hold none of its share) a later message asks for its share, unless
        it arrived meanwhile (in a join both sides send their share anyway)."""
        with self._lock:
            self._streams[owner] = _Stream(reset=True, ask_from=self._round + 2 if resync_me else -1)
            self._due.add(owner)

    def owner_left(self, owner: str) -> None:
        with self._lock:
            self._streams.pop(owner, None)
            self._due.discard(owner)
            self._retract.pop(owner, None)

    def retract(self, owner: str, buckets: Iterable[int]) -> None:
        """``owner`` no longer owns ``buckets``: send it removes of what we hold there."""
        with self._lock:
            if owner in self._streams:
                self._retract.setdefault(owner, set()).update(int(b) for b in buckets)

    def needs_reset(self, owner: str) -> None:
        """The owner refused a message (resync) or a send failed: send it the full share next."""
        with self._lock:
            stream = self._streams.get(owner)
            if stream is not None:
                stream.reset = True
                self._due.add(owner)

    def wants_share(self, owner: str) -> None:
        """The owner has nothing of ours (it asked with resync_me): send it the full share next."""
        self.needs_reset(owner)

    def republish(self, buckets: Iterable[int]) -> int:
        """Queue every held digest of ``buckets`` as an add (their owner changed); returns how many."""
        mask = np.zeros(1 << BUCKET_BITS, dtype=bool)
        mask[np.fromiter(buckets, dtype=np.int64)] = True
        shift = 64 - BUCKET_BITS
        with self._lock:
            moved = [d for d in self._held if mask[d >> shift]]
            for d in moved:
                if d not in self._pending:
                    self._change(d, self._held[d])
        return len(moved)

    # ---- publishing ------------------------------------------------------------------------

    def take(self, table: OwnerTable, busy: Collection[str] = (),
             has_state: Callable[[str], bool] = lambda owner: False) -> list[tuple[str, list[PublishBatch]]]:
        """The messages of one publish interval, by owner (owners in ``busy`` wait for the next).

        Owners owed a reset get every held digest of their buckets; the others the net
        changes of their buckets since their last message. A message asks its owner for
        the owner's own share (``resync_me``) only while ``has_state(owner)`` is false.
        """
        with self._lock:
            self._round += 1
            if self._overflow:
                self._overflow = False
                for owner, stream in self._streams.items():
                    stream.reset = True
                    self._due.add(owner)
            for first, tail in self._chains.items():  # chains through held keys: refresh their tails
                if first in self._held:
                    self._held[first] = self._pending[first] = tail
            self._chains.clear()
            resets = {o for o in self._due if self._streams[o].reset and o not in busy and o in table}
            changes: dict[str, tuple[list[tuple[int, int]], list[int]]] = {}  # adds carry COPY
            keep: dict[int, int] = {}
            self._take_retractions(table, busy, resets, changes)
            told = set()  # kept digests some owner heard of (no longer fresh)
            for d, value in self._pending.items():
                for owner in table.owners_of(d):
                    if owner in busy:  # (the others hear it again next time: adds and removes repeat)
                        keep[d] = value
                        continue
                    told.add(d)
                    if owner not in self._streams:  # an owner we never wrote to: it gets the full share
                        self._streams[owner] = _Stream()
                        resets.add(owner)
                    if owner in resets:
                        continue
                    adds, removes = changes.setdefault(owner, ([], []))
                    if value == REMOVED:
                        removes.append(d)
                    else:
                        adds.append((d, value))
            self._pending = keep
            self._fresh.intersection_update(keep)
            self._fresh.difference_update(told)
            if resets:
                shares: dict[str, list[tuple[int, int]]] = {o: [] for o in resets}
                for d, value in self._held.items():
                    for owner in table.owners_of(d):
                        if owner in shares:
                            shares[owner].append((d, value))
                for owner, adds in shares.items():
                    changes[owner] = (adds, [])
            asking = set()
            for owner in list(self._due):
                stream = self._streams[owner]
                if 0 <= stream.ask_from <= self._round and owner not in busy and owner in table:
                    stream.ask_from = -1
                    if not has_state(owner):  # its share did not come by itself
                        asking.add(owner)
                        changes.setdefault(owner, ([], []))
            out = []
            for owner, (adds, removes) in changes.items():
                stream = self._streams[owner]
                reset = owner in resets
                if not (adds or removes or reset or owner in asking):
                    continue
                out.append((owner, self._split(stream, reset, owner in asking, adds, removes)))
                stream.reset = False
            self._due = {o for o in self._due
                         if o in self._streams and (self._streams[o].reset or self._streams[o].ask_from >= 0)}
            return out

    def _take_retractions(self, table: OwnerTable, busy: Collection[str], resets: set[str],
                          changes: dict[str, tuple[list[tuple[int, int]], list[int]]]) -> None:
        """Removes for the owners pushed out of buckets (a reset, or owning them again, makes
        them moot; a busy owner gets them next time)."""
        shift = 64 - BUCKET_BITS
        for owner in list(self._retract):
            if owner in busy:
                continue
            buckets = self._retract.pop(owner)
            if owner not in table or owner in resets or owner not in self._streams:
                continue
            mask = np.zeros(1 << BUCKET_BITS, dtype=bool)
            mask[list(buckets)] = True
            mask &= ~table.owned_mask(owner)
            gone = [d for d in self._held if mask[d >> shift]]
            gone += [d for d, v in self._pending.items() if v == REMOVED and mask[d >> shift]]
            if gone:
                changes.setdefault(owner, ([], []))[1].extend(gone)

    def _split(self, stream: _Stream, reset: bool, ask: bool, adds: list[tuple[int, int]],
               removes: list[int]) -> list[PublishBatch]:
        """Messages of at most MAX_PUBLISH_RECORDS records, the first carrying ``reset``."""
        out = []
        first = True
        while first or adds or removes:
            room = MAX_PUBLISH_RECORDS
            part_r, removes = removes[:room], removes[room:]
            room -= len(part_r)
            part_a, adds = adds[:room], adds[room:]
            stream.seq += 1
            own = tuple((d, v) for d, v in part_a if not v & COPY)
            copies = tuple((d, v & ~COPY) for d, v in part_a if v & COPY)
            out.append(PublishBatch(self.epoch, stream.seq, reset and first, ask and first,
                                    own, tuple(part_r), copies))
            first = False
        return out
