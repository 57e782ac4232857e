"""The honest load of ``kv-offload bench attack``: one member stores, another loads.

Every round the writer's engine stores ``chunks_per_round`` new chunks
(``chaos.chunks``: bytes a function of the key) and the reader's engine looks
up and loads the chunks stored ``lag_seconds`` earlier (time for the pool's
chunk directory to learn them), verifying every byte. A round's load time is
what vLLM waits for its chunks (the peer fetch included); a hit is a chunk
delivered whole and right. ``stats(t0, t1)`` gives the hit ratio and p50/p99
of the loads issued in a window, so the bench compares the run without
attackers with each attack.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from kv_offload_sidecar.engine.client import EngineClient

from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks

# Seconds an engine load may take (the sidecars' fetch deadline is shorter).
LOAD_TIMEOUT = 3.0


@dataclass(frozen=True)
class Round:
    """One honest lookup + load."""

    # Monotonic time the lookup began.
    at: float
    # Chunks asked for, hit by the lookup, delivered right, delivered wrong.
    asked: int
    looked_up: int
    loaded: int
    wrong: int
    lookup_seconds: float
    load_seconds: float


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class HonestLoad(threading.Thread):
    """Stores on ``writer``, lookups and loads on ``reader``, every ``round_seconds``."""

    def __init__(self, writer: EngineClient, reader: EngineClient, chunk_bytes: int, *,
                 chunks_per_round: int = 4, round_seconds: float = 0.05, lag_seconds: float = 1.0) -> None:
        super().__init__(name="kvo-attack-honest", daemon=True)
        self.writer, self.reader = writer, reader
        self.chunk_bytes = chunk_bytes
        self.chunks_per_round = chunks_per_round
        self.round_seconds = round_seconds
        self.lag_seconds = lag_seconds
        self.rounds: list[Round] = []
        # Chunks the writer's sidecar refused to store (should stay 0).
        self.not_stored = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def run(self) -> None:
        pending: collections.deque[tuple[float, list[bytes]]] = collections.deque()
        r = 0
        next_tick = time.monotonic()
        try:
            while not self._halt.is_set():
                keys = chunk_keys(f"honest/{r}", self.chunks_per_round)
                r += 1
                self.not_stored += len(keys) - store_chunks(self.writer, keys, self.chunk_bytes)
                pending.append((time.monotonic(), keys))
                while pending and time.monotonic() - pending[0][0] >= self.lag_seconds:
                    self._load(pending.popleft()[1])
                next_tick += self.round_seconds
                self._halt.wait(max(0.0, next_tick - time.monotonic()))
                next_tick = max(next_tick, time.monotonic() - self.round_seconds)
        except BaseException as exc:  # reported by the bench, never silent
            self.error = exc

    def _load(self, keys: list[bytes]) -> None:
        at = time.monotonic()
        reply = self.reader.lookup(keys, LOAD_TIMEOUT)
        t1 = time.monotonic()
        loaded, wrong = load_and_verify(self.reader, keys, self.chunk_bytes, LOAD_TIMEOUT)
        t2 = time.monotonic()
        with self._lock:
            self.rounds.append(Round(at, len(keys), reply.hits, loaded - wrong, wrong, t1 - at, t2 - t1))

    def window(self, t0: float, t1: float) -> list[Round]:
        with self._lock:
            return [r for r in self.rounds if t0 <= r.at < t1]

    def stats(self, t0: float, t1: float) -> dict[str, float]:
        """Hit ratio, wrong chunks and load/lookup percentiles (ms) of the rounds begun in [t0, t1)."""
        rounds = self.window(t0, t1)
        asked = sum(r.asked for r in rounds)
        loads = [r.load_seconds for r in rounds]
        lookups = [r.lookup_seconds for r in rounds]
        return {
            "rounds": len(rounds), "asked": asked, "loaded": sum(r.loaded for r in rounds),
            "wrong": sum(r.wrong for r in rounds),
            "hit_ratio": round(sum(r.loaded for r in rounds) / asked, 4) if asked else None,
            "load_p50_ms": round(1e3 * quantile(loads, 0.5), 2),
            "load_p99_ms": round(1e3 * quantile(loads, 0.99), 2),
            "lookup_p99_ms": round(1e3 * quantile(lookups, 0.99), 2),
        }
