"""Which member keeps the location of which chunks: rendezvous-hashed buckets.

A digest falls in one of ``BUCKETS`` buckets (its top 16 bits). A bucket's
*owner* is the member with the highest score ``mix64(member hash + bucket x
golden)`` (rendezvous or highest-random-weight hashing, Thaler and Ravishankar
1998), so every sidecar that sees the same members computes the same owners
with no coordinator. A member that joins takes exactly the buckets where it
scores highest (about 1/N of them, from all others alike); one that leaves
hands each of its buckets to that bucket's runner-up. Nothing else moves.

The table is numpy arrays: 65536 owners and their best scores (768 KiB),
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
MAX_MEMBERS = 65535
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
    """Owner of every bucket among the current members (this sidecar is always one)."""

    def __init__(self, identity: str) -> None:
        # This sidecar's identity.
        self.identity = identity
        self._names: list[str | None] = []
        self._index: dict[str, int] = {}
        self._owner = np.zeros(BUCKETS, dtype=np.uint16)
        self._best = np.zeros(BUCKETS, dtype=np.uint64)
        self.add(identity)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, identity: object) -> bool:
        return identity in self._index

    def members(self) -> list[str]:
        return list(self._index)

    def owner_of(self, digest: int) -> str:
        """The member keeping ``digest``'s location."""
        return self._names[int(self._owner[digest >> (64 - BUCKET_BITS)])]  # type: ignore[return-value]

    def owner_of_bucket(self, bucket: int) -> str:
        return self._names[int(self._owner[bucket])]  # type: ignore[return-value]

    def buckets_of(self, identity: str) -> np.ndarray:
        """Buckets ``identity`` owns (empty when it is not a member)."""
        i = self._index.get(identity)
        if i is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self._owner == i)

    def owned_mask(self, identity: str) -> np.ndarray:
        """Boolean mask of the buckets ``identity`` owns."""
        i = self._index.get(identity)
        return self._owner == i if i is not None else np.zeros(BUCKETS, dtype=bool)

    def add(self, identity: str) -> np.ndarray:
        """``identity`` joins; returns the buckets it takes over (their old owners lose them)."""
        if identity in self._index:
            return np.zeros(0, dtype=np.int64)
        if len(self._index) >= MAX_MEMBERS:
            raise ValueError(f"a pool holds at most {MAX_MEMBERS} members; {identity!r} is one too many")
        i = self._names.index(None) if None in self._names else len(self._names)
        if i == len(self._names):
            self._names.append(identity)
        else:
            self._names[i] = identity
        self._index[identity] = i
        s = scores(identity)
        if len(self._index) == 1:
            moved = np.arange(BUCKETS)
        else:
            moved = np.flatnonzero(s > self._best)
        self._owner[moved] = i
        self._best[moved] = s[moved]
        return moved

    def remove(self, identity: str) -> np.ndarray:
        """``identity`` leaves; returns the buckets it owned (each now with its runner-up)."""
        i = self._index.get(identity)
        if i is None or identity == self.identity:
            return np.zeros(0, dtype=np.int64)
        moved = np.flatnonzero(self._owner == i)
        del self._index[identity]
        self._names[i] = None
        if moved.size:
            best = np.zeros(moved.size, dtype=np.uint64)
            owner = np.zeros(moved.size, dtype=np.uint16)
            ids = _BUCKET_IDS[moved]
            for name, j in self._index.items():
                s = scores(name, ids)
                better = s > best
                best[better] = s[better]
                owner[better] = j
            self._best[moved] = best
            self._owner[moved] = owner
        return moved

    def memory_bytes(self) -> int:
        """Bytes of the arrays (the table's share of location memory)."""
        return int(self._owner.nbytes + self._best.nbytes)
