"""The owner's side of the chunk directory: who holds the chunks of the buckets it owns.

Holders publish their gains and losses to each digest's owner
(``ownership.OwnerTable``); the owner keeps, per digest, every holder, the
most recent publisher first, each with the last ``TAILS`` tails it published
(a tail: the low 32 bits of the digest of the last key of a chain through the
chunk, a stored batch or a request it served), and whether its copy came from
a peer (its store evicts such copies first). A locate names the holders of the
first digest asked: the one with a tail deepest in the asked digests first (its
chain covers that much of the request), then holders of their own copy before
holders of a peer's, then the most recent; each with the run its tail claims.

Memory: one dict entry per digest. A digest with one holder and one tail
(most of them) is an int key and an int value packing holder id and tail,
about 110 bytes; others hold a small dict {holder id: tail or tails}. An
owner keeps about ``pool chunks / members`` digests: the pool's total divided
among its members, whatever their number.

Streams. Each holder's publishes carry ``(epoch, seq)``; a publish that does
not follow the last one applied (a lost message, a restart of either side, a
purge) is refused with ``resync`` and the holder sends its full share
(``reset``). A holder that leaves the owner's view is purged. Everything runs
on the sidecar's event loop (no locks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kv_offload_sidecar.peers.directory.location_wire import (
    MAX_LOCATE_HOLDERS,
    TAIL_MASK,
    HolderClaim,
    PublishBatch,
)
from kv_offload_sidecar.peers.directory.ownership import BUCKET_BITS

# Tails kept per (digest, holder): the chains through it that holder published last.
TAILS = 4
# Entries one holder may keep at one owner (bounds what a lying member can make us store).
MAX_ENTRIES_PER_HOLDER = 1 << 20
# Holders named in one locate reply.
LOCATE_HOLDERS = 4
# Bit of a holder's first tail that marks its copy as fetched from a peer.
COPY_BIT = 1 << 32
# A holder's tails: its first tail (with COPY_BIT), or a tuple (first, older tails...).
# An entry: (holder id << 33 | first tail) for one holder with one tail, else
# {holder id: tails}, the most recent publisher last.
_FIRST = (1 << 33) - 1
Entry = int | dict[int, int | tuple[int, ...]]


def _tails(t: int | tuple[int, ...]) -> tuple[int, ...]:
    return (t & TAIL_MASK,) if isinstance(t, int) else (t[0] & TAIL_MASK,) + t[1:]


def _is_copy(t: int | tuple[int, ...]) -> bool:
    return bool((t if isinstance(t, int) else t[0]) & COPY_BIT)


def _holders(v: Entry) -> Iterator[tuple[int, int | tuple[int, ...]]]:
    """(holder id, tails) of an entry, the most recent publisher first."""
    if isinstance(v, int):
        yield v >> 33, v & _FIRST
    else:
        yield from reversed(v.items())


class Directory:
    """Digest -> holders (with tails) for the buckets this sidecar owns."""

    def __init__(self, *, tails: int = TAILS, max_entries_per_holder: int = MAX_ENTRIES_PER_HOLDER) -> None:
        self._max_tails = tails
        self._max_per_holder = max_entries_per_holder
        self._entries: dict[int, Entry] = {}
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_id = 0
        self._count: dict[int, int] = {}  # holder id -> entries
        self._streams: dict[int, tuple[str, int]] = {}  # holder id -> (epoch, last seq applied)
        self._size = 0

    def __len__(self) -> int:
        """(digest, holder) entries kept."""
        return self._size

    def digests(self) -> int:
        return len(self._entries)

    def holders(self) -> list[str]:
        return [self._names[i] for i, n in self._count.items() if n]

    def entries_of(self, holder: str) -> int:
        i = self._ids.get(holder)
        return self._count.get(i, 0) if i is not None else 0

    def has_stream(self, holder: str) -> bool:
        """True when publishes from ``holder`` have been applied since it was last purged."""
        i = self._ids.get(holder)
        return i is not None and i in self._streams

    def holders_of(self, digest: int) -> list[str]:
        v = self._entries.get(digest)
        return [] if v is None else [self._names[h] for h, _ in _holders(v)]

    # ---- publishes ------------------------------------------------------------------

    def apply(self, holder: str, batch: PublishBatch) -> bool:
        """Apply one publish of ``holder``; returns True (resync) when it does not follow its stream."""
        hid = self._id(holder)
        state = self._streams.get(hid)
        if batch.reset:
            if self._count.get(hid):
                self._drop_holder(hid)
        elif state is None or state[0] != batch.epoch or batch.seq != state[1] + 1:
            return True
        self._streams[hid] = (batch.epoch, batch.seq)
        for d in batch.removes:
            self._remove(d, hid)
        for d, tail in batch.copies:
            self._add(d, hid, tail & TAIL_MASK, copy=True)
        for d, tail in batch.adds:
            self._add(d, hid, tail & TAIL_MASK)
        return False

    def purge(self, holder: str) -> int:
        """Forget ``holder`` (it left): its entries and its stream; returns entries dropped."""
        hid = self._ids.get(holder)
        if hid is None:
            return 0
        n = self._drop_holder(hid) if self._count.get(hid) else 0
        self._streams.pop(hid, None)
        self._count.pop(hid, None)
        del self._ids[holder], self._names[hid]
        return n

    def drop_buckets(self, gone: np.ndarray) -> int:
        """Drop the entries of the buckets ``gone`` marks (a bool per bucket: no longer ours)."""
        if not self._entries:
            return 0
        digests = np.fromiter(self._entries.keys(), dtype=np.uint64, count=len(self._entries))
        doomed = digests[gone[digests >> np.uint64(64 - BUCKET_BITS)]]
        dropped = 0
        for d in doomed.tolist():
            for h, _ in _holders(self._entries.pop(d)):
                self._count[h] -= 1
                dropped += 1
        self._size -= dropped
        return dropped

    # ---- queries ------------------------------------------------------------------

    def locate(self, digests: Sequence[int], exclude: str | None = None,
               limit: int = LOCATE_HOLDERS) -> tuple[HolderClaim, ...]:
        """Holders of ``digests[0]``: deepest tail within ``digests`` first, then own copies before
        copies from peers, then the most recent."""
        v = self._entries.get(digests[0]) if digests else None
        if v is None:
            return ()
        skip = self._ids.get(exclude) if exclude is not None else None
        depth: dict[int, int] = {}
        for i, d in enumerate(digests):
            depth.setdefault(d & TAIL_MASK, i)
        scored = [(max(depth.get(t, 0) for t in _tails(tails)), _is_copy(tails), h)
                  for h, tails in _holders(v) if h != skip]
        scored.sort(key=lambda x: (-x[0], x[1]))  # stable: recency breaks ties
        return tuple(HolderClaim(self._names[h], n + 1) for n, _, h in scored[:min(limit, MAX_LOCATE_HOLDERS)])

    # ---- internals ------------------------------------------------------------------

    def _id(self, holder: str) -> int:
        hid = self._ids.get(holder)
        if hid is None:
            hid = self._next_id
            self._next_id += 1
            self._ids[holder] = hid
            self._names[hid] = holder
        return hid

    def _add(self, d: int, hid: int, tail: int, *, copy: bool = False) -> None:
        first = (COPY_BIT if copy else 0) | tail
        v = self._entries.get(d)
        if v is None:
            if self._count.get(hid, 0) >= self._max_per_holder:
                return
            self._count[hid] = self._count.get(hid, 0) + 1
            self._size += 1
            self._entries[d] = (hid << 33) | first
            return
        if isinstance(v, int) and v >> 33 == hid and v & _FIRST == first:
            return
        holders = {v >> 33: v & _FIRST} if isinstance(v, int) else v
        old = holders.pop(hid, None)
        if old is None:  # a new holder of d
            if self._count.get(hid, 0) >= self._max_per_holder:
                return  # (a dict v is unchanged: hid was not in it)
            self._count[hid] = self._count.get(hid, 0) + 1
            self._size += 1
            holders[hid] = first
        else:  # the holder published a (new) chain through d: its tail goes first
            older = tuple(t for t in _tails(old) if t != tail)[:self._max_tails - 1]
            holders[hid] = (first,) + older if older else first
        self._entries[d] = holders

    def _remove(self, d: int, hid: int) -> None:
        v = self._entries.get(d)
        if v is None:
            return
        if isinstance(v, int):
            if v >> 33 != hid:
                return
            del self._entries[d]
        else:
            if v.pop(hid, None) is None:
                return
            if not v:
                del self._entries[d]
            elif len(v) == 1:
                (h, t), = v.items()
                if isinstance(t, int):
                    self._entries[d] = (h << 33) | t
        self._count[hid] -= 1
        self._size -= 1

    def _drop_holder(self, hid: int) -> int:
        """Remove every entry of holder ``hid``; returns how many."""
        doomed = [d for d, v in self._entries.items()
                  if (v >> 33 == hid if isinstance(v, int) else hid in v)]
        for d in doomed:
            self._remove(d, hid)
        return len(doomed)
