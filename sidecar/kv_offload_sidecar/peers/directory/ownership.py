"""Which member keeps the location of which chunks: rendezvous-hashed buckets.

A digest falls in one of ``BUCKETS`` buckets (its top 16 bits). A bucket's
*owners* are the ``OWNERS`` members with the highest scores ``mix64(member hash
+ bucket x golden)`` (rendezvous or highest-random-weight hashing, Thaler and
Ravishankar 1998), best first: the *primary* (``owner_of``), whom reads ask,
and the runner-up, whom reads ask when the primary cannot answer. Every
sidecar that sees the same members computes the same owners with no
coordinator, and two sidecars whose views differ by one member (an
asymmetric partition: one cannot dial the other) still share an owner of
every bucket. A member that joins enters exactly the buckets where it scores
among the best two (about 2/N of them, from all others alike) and pushes their
old runner-up out (``add`` says whom); one that leaves hands each of its
places to the next best. Nothing else moves.

The table is numpy arrays: per bucket two owners and their scores (1.2 MiB),
updated in O(buckets) per join and O(buckets / N x N) per leave.
"""

from __future__ import annotations

import hashlib

import numpy as np

# Bits of a digest that pick its bucket (the top ones).
BUCKET_BITS = 16
# Buckets of the table; a member owns about BUCKETS / members of them.
BUCKETS = 1 << BUCKET_BITS
# Most members one table tracks (member indices are uint16-sized).
MAX_MEMBERS = 65534
# Owners of each bucket (every holder publishes to all of them).
OWNERS = 2
# Owner index meaning "none" (a table of one member has no runner-up).
_NONE = np.uint16(0xFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BUCKET_IDS = np.arange(BUCKETS, dtype=np.uint64)


def member_hash(identity: str) -> int:
    """The 64-bit hash that seeds a member's scores."""
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "big")


def scores(identity: str, buckets: np.ndarray = _BUCKET_IDS) -> np.ndarray:
    """Rendezvous scores of ``identity`` for ``buckets`` (splitmix64 of hash + bucket x golden)."""
    with np.errstate(over="ignore"):
        z = np.uint64(member_hash(identity)) + buckets.astype(np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


class OwnerTable:
    """The owners of every bucket among the current members (this sidecar is always one)."""

    def __init__(self, identity: str) -> None:
        # This sidecar's identity.
        self.identity = identity
        self._names: list[str | None] = []
        self._index: dict[str, int] = {}
        self._owner = np.full((OWNERS, BUCKETS), _NONE, dtype=np.uint16)  # best first
        self._best = np.zeros((OWNERS, BUCKETS), dtype=np.uint64)
        self.add(identity)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, identity: object) -> bool:
        return identity in self._index

    def members(self) -> list[str]:
        return list(self._index)

    def owners_per_bucket(self) -> int:
        """Owners each digest is published to: ``OWNERS``, or fewer members."""
        return min(OWNERS, len(self._index))

    def owner_of(self, digest: int) -> str:
        """The primary owner of ``digest``'s location (whom reads ask first)."""
        return self._names[int(self._owner[0, digest >> (64 - BUCKET_BITS)])]  # type: ignore[return-value]

    def owners_of(self, digest: int) -> list[str]:
        """Every owner of ``digest``'s location, best first."""
        return self.owners_of_bucket(digest >> (64 - BUCKET_BITS))

    def owner_of_bucket(self, bucket: int) -> str:
        return self._names[int(self._owner[0, bucket])]  # type: ignore[return-value]

    def owners_of_bucket(self, bucket: int) -> list[str]:
        return [self._names[int(i)] for i in self._owner[:, bucket] if i != _NONE]  # type: ignore[misc]

    def buckets_of(self, identity: str) -> np.ndarray:
        """Buckets ``identity`` is an owner of (empty when it is not a member)."""
        return np.flatnonzero(self.owned_mask(identity))

    def owned_mask(self, identity: str) -> np.ndarray:
        """Boolean mask of the buckets ``identity`` is an owner of."""
        i = self._index.get(identity)
        return (self._owner == i).any(axis=0) if i is not None else np.zeros(BUCKETS, dtype=bool)

    def add(self, identity: str) -> np.ndarray:
        """``identity`` joins; returns the buckets where it became an owner."""
        return self.join(identity)[0]

    def join(self, identity: str) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
        """``identity`` joins: (the buckets where it became an owner, [(member, the buckets it is
        no longer an owner of)])."""
        if identity in self._index:
            return np.zeros(0, dtype=np.int64), []
        if len(self._index) >= MAX_MEMBERS:
            raise ValueError(f"a pool holds at most {MAX_MEMBERS} members; {identity!r} is one too many")
        i = self._names.index(None) if None in self._names else len(self._names)
        if i == len(self._names):
            self._names.append(identity)
        else:
            self._names[i] = identity
        self._index[identity] = i
        s = scores(identity)
        ousted = self._owner[OWNERS - 1].copy()
        place = np.full(BUCKETS, OWNERS, dtype=np.int64)  # where the newcomer ranks (OWNERS: nowhere)
        for rank in range(OWNERS - 1, -1, -1):
            beats = (s > self._best[rank]) | (self._owner[rank] == _NONE)
            place[beats] = rank
        moved = np.flatnonzero(place < OWNERS)
        for rank in range(OWNERS - 1, -1, -1):  # shift the worse ones down, then insert
            at = moved[place[moved] <= rank]
            if rank > 0:
                shift = at[place[at] < rank]
                self._owner[rank, shift] = self._owner[rank - 1, shift]
                self._best[rank, shift] = self._best[rank - 1, shift]
            here = at[place[at] == rank]
            self._owner[rank, here] = i
            self._best[rank, here] = s[here]
        out = ousted[moved]
        lost = [(self._names[int(j)], moved[out == j]) for j in np.unique(out) if j != _NONE]
        return moved, lost  # type: ignore[return-value]

    def remove(self, identity: str) -> np.ndarray:
        """``identity`` leaves; returns the buckets it owned (each with the next best now)."""
        i = self._index.get(identity)
        if i is None or identity == self.identity:
            return np.zeros(0, dtype=np.int64)
        moved = np.flatnonzero((self._owner == i).any(axis=0))
        del self._index[identity]
        self._names[i] = None
        if moved.size:
            ids = _BUCKET_IDS[moved]
            best = np.zeros((OWNERS, moved.size), dtype=np.uint64)
            owner = np.full((OWNERS, moved.size), _NONE, dtype=np.uint16)
            for j in self._index.values():
                s = scores(self._names[j], ids)  # type: ignore[arg-type]
                placed = np.zeros(moved.size, dtype=bool)
                for rank in range(OWNERS):
                    better = ~placed & ((s > best[rank]) | (owner[rank] == _NONE))
                    for lower in range(OWNERS - 1, rank, -1):
                        best[lower, better] = best[lower - 1, better]
                        owner[lower, better] = owner[lower - 1, better]
                    best[rank, better] = s[better]
                    owner[rank, better] = j
                    placed |= better
            self._best[:, moved] = best
            self._owner[:, moved] = owner
        return moved

    def memory_bytes(self) -> int:
        """Bytes of the arrays (the table's share of location memory)."""
        return int(self._owner.nbytes + self._best.nbytes)
