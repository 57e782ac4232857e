"""Where chunks are: sequence-numbered key-summary deltas exchanged between peers.

Scheme. Every sidecar keeps a ``SummaryLog``: the set of 8-byte digests
(``blake2b(key, digest_size=8)``) of the chunks its store holds, and a log of
``(seq, digest, present)`` changes fed by the store's ``on_change``
callback. Each connected peer pulls ``GET /v1/summary?since=N`` every
``summary_interval_seconds`` and gets the changes after ``N`` (or, when
``N`` has fallen out of the bounded log or names another epoch, a full
snapshot with ``reset``). The puller keeps one ``PeerSummaries`` with a digest
set per peer.

Lookups. An engine lookup first takes the local store's hit prefix, then asks
``PeerSummaries.choose`` which peer's summary covers the longest run of the
remaining keys, and sends one lookup to that peer only. So the lookup
messages per engine request are 0 (all local, or nobody has the next key) or
1, whatever the number of peers; only the periodic summary pulls grow with
the pool, and they are independent of the request rate.

Staleness. A summary is at most one interval (plus one pull's latency) old.
A chunk stored on a peer after its last pull is not seen until the next pull
(a miss, vLLM recomputes); a chunk evicted after the last pull is a false
positive, answered by the peer's exact lookup as a miss for that key, which
costs one message and no wrong data. Digest collisions (8 bytes, about
2**-64 per pair) are false positives of the same harmless kind: the peer
checks full keys.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DIGEST_BYTES = 8
# Changes kept for delta pulls; older "since" values get a full snapshot.
DEFAULT_LOG_LIMIT = 65536
# Largest digest list accepted in one summary reply (bounds memory per peer).
MAX_SUMMARY_DIGESTS = 1 << 20


def key_digest(key: bytes) -> bytes:
    """The 8-byte digest that stands for a chunk key in summaries."""
    return hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()


def pack_digests(digests: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(digests)).decode("ascii")


def unpack_digests(text: Any) -> list[bytes]:
    """Inverse of pack_digests; raises ValueError on anything malformed."""
    if not isinstance(text, str):
        raise ValueError("digest list must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError("digest list is not valid base64") from None
    if len(raw) % DIGEST_BYTES:
        raise ValueError(f"digest list length {len(raw)} is not a multiple of {DIGEST_BYTES}")
    if len(raw) // DIGEST_BYTES > MAX_SUMMARY_DIGESTS:
        raise ValueError(f"digest list holds more than {MAX_SUMMARY_DIGESTS} digests")
    return [raw[i:i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)]


@dataclass(frozen=True)
class SummaryDelta:
    """One pull's answer: changes after ``since`` (or a snapshot when ``reset``)."""

    # Identifies one log's lifetime; a new epoch (restart) forces a reset.
    epoch: str
    # Sequence number the puller asks "since" next time.
    seq: int
    # True when added is the full set and the puller must drop what it had.
    reset: bool
    # Digests that became present.
    added: tuple[bytes, ...]
    # Digests that went away.
    removed: tuple[bytes, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": self.seq, "reset": self.reset,
                "added": pack_digests(self.added), "removed": pack_digests(self.removed)}

    @classmethod
    def from_dict(cls, d: Any) -> "SummaryDelta":
        if not isinstance(d, dict):
            raise ValueError("summary must be a JSON object")
        epoch, seq, reset = d.get("epoch"), d.get("seq"), d.get("reset")
        if not isinstance(epoch, str) or not 0 < len(epoch) <= 64:
            raise ValueError("summary epoch must be a short string")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError("summary seq must be a non-negative integer")
        if not isinstance(reset, bool):
            raise ValueError("summary reset must be a boolean")
        return cls(epoch, seq, reset, tuple(unpack_digests(d.get("added"))),
                   tuple(unpack_digests(d.get("removed"))))


class SummaryLog:
    """This sidecar's own summary: present digests plus a bounded change log.

    Thread-safe: the store calls ``record`` from any thread.
    """

    def __init__(self, log_limit: int = DEFAULT_LOG_LIMIT) -> None:
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._present: dict[bytes, int] = {}  # digest -> number of keys with it
        self._log: deque[tuple[int, bytes, bool]] = deque(maxlen=log_limit)
        self._seq = 0

    @property
    def seq(self) -> int:
        return self._seq

    def record(self, key: bytes, present: bool) -> None:
        """Store callback: ``key`` became visible (True) or was evicted (False)."""
        d = key_digest(key)
        with self._lock:
            n = self._present.get(d, 0)
            if present:
                self._present[d] = n + 1
                if n:
                    return
            else:
                if n == 0:
                    return
                if n > 1:
                    self._present[d] = n - 1
                    return
                del self._present[d]
            self._seq += 1
            self._log.append((self._seq, d, present))

    def __len__(self) -> int:
        return len(self._present)

    def delta_since(self, since: int, epoch: str | None = None) -> SummaryDelta:
        """Changes after ``since``; a full snapshot when the log cannot tell."""
        with self._lock:
            oldest = self._log[0][0] if self._log else self._seq + 1
            if epoch != self.epoch or since > self._seq or since < oldest - 1:
                return SummaryDelta(self.epoch, self._seq, True, tuple(self._present), ())
            net: dict[bytes, bool] = {}
            for seq, d, present in self._log:
                if seq > since:
                    net[d] = present
            return SummaryDelta(
                self.epoch, self._seq, False,
                tuple(d for d, p in net.items() if p), tuple(d for d, p in net.items() if not p))


class PeerSummaries:
    """What every connected peer holds, as far as its last pulled summary says."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[str, set[bytes]] = {}
        self._cursor: dict[str, tuple[str, int]] = {}

    def cursor(self, peer: str) -> tuple[str | None, int]:
        """``(epoch, seq)`` to send on the next pull from ``peer``."""
        with self._lock:
            epoch, seq = self._cursor.get(peer, (None, 0))
            return epoch, seq

    def apply(self, peer: str, delta: SummaryDelta) -> None:
        with self._lock:
            s = self._sets.setdefault(peer, set())
            if delta.reset:
                s.clear()
            s.difference_update(delta.removed)
            s.update(delta.added)
            self._cursor[peer] = (delta.epoch, delta.seq)

    def forget(self, peer: str) -> None:
        """Drop a peer that left or failed (its chunks are no longer offered)."""
        with self._lock:
            self._sets.pop(peer, None)
            self._cursor.pop(peer, None)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._sets)

    def holds(self, peer: str, key: bytes) -> bool:
        with self._lock:
            return key_digest(key) in self._sets.get(peer, ())

    def size(self, peer: str) -> int:
        with self._lock:
            return len(self._sets.get(peer, ()))

    def choose(self, keys: Sequence[bytes], exclude: Iterable[str] = ()) -> tuple[str | None, int]:
        """The peer whose summary covers the longest leading run of ``keys``.

        Returns ``(peer, run_length)``; ``(None, 0)`` when no peer claims the
        first key. Costs no message; ties go to the peer listed first.
        """
        if not keys:
            return None, 0
        digests = [key_digest(k) for k in keys]
        skip = set(exclude)
        best, best_n = None, 0
        with self._lock:
            for peer, s in self._sets.items():
                if peer in skip or digests[0] not in s:
                    continue
                n = 0
                for d in digests:
                    if d not in s:
                        break
                    n += 1
                if n > best_n:
                    best, best_n = peer, n
        return best, best_n
