"""The location schemes ``bench scale`` weighs the directory against, costed from measurements.

- ``exact``: the previous design. Every sidecar keeps every peer's exact set
  of 8-byte digests and pulls every peer's changes every interval. Memory:
  (pods - 1) x chunks x the bytes one entry of that set takes (measured on a
  real set); traffic: (pods - 1) pulls per interval, each carrying the peer's
  changes (JSON, base64) plus the measured HTTP overhead. Two messages per
  peer-hit request (lookup, fetch); it is the reference of the hit ratio.
- ``bloom``: per-peer Bloom filters (Summary Cache, Fan, Cao, Almeida and
  Broder, SIGCOMM 1998). A lookup checks every peer's filter, so keeping the
  pool's false positives at ``fp_budget`` per lookup needs a per-filter rate
  of fp_budget / (pods - 1): bits per entry = -ln(p) / ln(2)^2. The rate is
  measured on a real filter of that size. Memory: (pods - 1) x chunks x bits
  / 8; traffic: every change flips k counters that every peer must hear
  (Summary Cache's delta updates: 4 bytes per flipped position).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from kv_offload_tools.bench.scale.measure import HttpOverhead, deep_size

# Bytes of a GET /v1/summary request line and headers beyond the measured POST overhead's
# (a GET carries the cursor in the query string instead of a Content-Length).
PULL_QUERY_BYTES = 40
# JSON of an exact-scheme delta besides its digests: epoch, seq, reset, the keys.
DELTA_ENVELOPE_BYTES = 80


def exact_entry_bytes(entries: int = 50_000) -> float:
    """Bytes per digest of the exact scheme's per-peer set (a set of 8-byte ``bytes``), measured."""
    rng = random.Random(7)
    peer = {rng.getrandbits(64).to_bytes(8, "big") for _ in range(entries)}
    return deep_size(peer) / len(peer)


@dataclass(frozen=True)
class Costs:
    """One scheme's figures per sidecar."""

    # Location memory of one sidecar (bytes).
    memory_bytes: float
    # Control bytes per second one sidecar sends (= receives, by symmetry).
    bytes_per_second_each_way: float
    # Control messages per second one sidecar sends.
    messages_per_second: float


def exact_costs(pods: int, chunks: int, changes: float, interval: float, overhead: HttpOverhead,
                entry_bytes: float) -> Costs:
    delta = DELTA_ENVELOPE_BYTES + math.ceil(changes * interval * 8 / 3) * 4
    per_pull = overhead.request + PULL_QUERY_BYTES + overhead.response + delta
    return Costs(memory_bytes=(pods - 1) * chunks * entry_bytes,
                 bytes_per_second_each_way=(pods - 1) * per_pull / interval,
                 messages_per_second=(pods - 1) / interval)


class BloomFilter:
    """A plain Bloom filter: ``bits`` bits, ``k`` positions per key by double hashing."""

    def __init__(self, bits: int, k: int) -> None:
        self.bits = bits
        self.k = k
        self.array = bytearray((bits + 7) // 8)

    def _positions(self, key: bytes) -> list[int]:
        h = hashlib.blake2b(key, digest_size=16).digest()
        a, b = int.from_bytes(h[:8], "big"), int.from_bytes(h[8:], "big") | 1
        return [(a + i * b) % self.bits for i in range(self.k)]

    def add(self, key: bytes) -> None:
        for p in self._positions(key):
            self.array[p >> 3] |= 1 << (p & 7)

    def __contains__(self, key: bytes) -> bool:
        return all(self.array[p >> 3] >> (p & 7) & 1 for p in self._positions(key))


def bloom_shape(pods: int, fp_budget: float) -> tuple[float, int, float]:
    """(bits per entry, k, per-filter false-positive rate) keeping a lookup's false positives
    over all pods - 1 filters at ``fp_budget``."""
    p = fp_budget / max(1, pods - 1)
    bits = -math.log(p) / math.log(2) ** 2
    return bits, max(1, round(bits * math.log(2))), p


def bloom_measured_rate(bits_per_entry: float, k: int, entries: int = 20_000, probes: int = 100_000,
                        seed: int = 3) -> float:
    """False-positive rate of a real filter of that shape (keys never added, probed)."""
    rng = random.Random(seed)
    f = BloomFilter(max(8, int(entries * bits_per_entry)), k)
    for _ in range(entries):
        f.add(rng.getrandbits(128).to_bytes(16, "big"))
    hits = sum(rng.getrandbits(128).to_bytes(16, "big") in f for _ in range(probes))
    return hits / probes


def bloom_costs(pods: int, chunks: int, changes: float, interval: float, overhead: HttpOverhead,
                bits_per_entry: float, k: int) -> Costs:
    per_message = overhead.request + overhead.response + DELTA_ENVELOPE_BYTES + changes * interval * k * 4
    return Costs(memory_bytes=(pods - 1) * chunks * bits_per_entry / 8,
                 bytes_per_second_each_way=(pods - 1) * per_message / interval,
                 messages_per_second=(pods - 1) / interval)
