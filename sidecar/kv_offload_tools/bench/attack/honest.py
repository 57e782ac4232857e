"""The honest load of ``kv-offload bench attack``: one member stores, another loads.

It runs in a process of its own, so the attackers' threads cost it only what they
cost the machine.

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
import contextlib
import multiprocessing
import threading
import time
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient

from kv_offload_tools.bench.quantile import quantile
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


class HonestLoad:
    """Stores through ``writer``'s engine, lookups and loads through ``reader``'s, every
    ``round_seconds``, in a process of its own (the attackers' threads in the bench's process
    must not slow the honest engines down through its GIL); the rounds come back on a pipe."""

    def __init__(self, writer: tuple[str, int], reader: tuple[str, int], chunk_bytes: int, *,
                 chunks_per_round: int = 4, round_seconds: float = 0.05, lag_seconds: float = 1.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_honest_main, name="kvo-attack-honest", daemon=True,
                                 args=(child, writer, reader, chunk_bytes, chunks_per_round,
                                       round_seconds, lag_seconds))
        self.rounds: list[Round] = []
        # Chunks the writer's sidecar refused to store (should stay 0).
        self.not_stored = 0
        self.error: str | None = None
        self._lock = threading.Lock()
        self._drain = threading.Thread(target=self._receive, name="kvo-attack-honest-rx", daemon=True)

    def start(self) -> None:
        self._proc.start()
        self._drain.start()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._conn.send("stop")
        self._drain.join(30)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _receive(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return
            kind, value = msg
            if kind == "round":
                with self._lock:
                    self.rounds.append(Round(*value))
            elif kind == "not_stored":
                self.not_stored = value
            elif kind == "error":
                self.error = value
            elif kind == "done":
                return

    def window(self, *windows: tuple[float, float]) -> list[Round]:
        with self._lock:
            return [r for r in self.rounds if any(t0 <= r.at < t1 for t0, t1 in windows)]

    def stats(self, t0: float, t1: float, *more: tuple[float, float]) -> dict[str, Any]:
        """Hit ratio, wrong chunks and load/lookup percentiles (ms) of the rounds begun in
        [t0, t1) (and in the ``more`` windows)."""
        rounds = self.window((t0, t1), *more)
        asked = sum(r.asked for r in rounds)
        loads = [r.load_seconds for r in rounds]
        lookups = [r.lookup_seconds for r in rounds]
        ms = lambda values, q: round(1e3 * (quantile(values, q) or 0.0), 2)  # noqa: E731
        return {
            "rounds": len(rounds), "asked": asked, "loaded": sum(r.loaded for r in rounds),
            "wrong": sum(r.wrong for r in rounds),
            "hit_ratio": round(sum(r.loaded for r in rounds) / asked, 4) if asked else None,
            "load_p50_ms": ms(loads, 0.5),
            "load_p99_ms": ms(loads, 0.99),
            "lookup_p99_ms": ms(lookups, 0.99),
        }


def _honest_main(conn: Any, writer_at: tuple[str, int], reader_at: tuple[str, int], chunk_bytes: int,
                 chunks_per_round: int, round_seconds: float, lag_seconds: float) -> None:
    """The honest process: rounds until the parent says stop (or goes away)."""
    writer = EngineClient.connect(*writer_at)
    reader = EngineClient.connect(*reader_at)
    pending: collections.deque[tuple[float, list[bytes]]] = collections.deque()
    not_stored = 0
    r = 0
    next_tick = time.monotonic()
    try:
        while not conn.poll(max(0.0, next_tick - time.monotonic())):
            keys = chunk_keys(f"honest/{r}", chunks_per_round)
            r += 1
            not_stored += len(keys) - store_chunks(writer, keys, chunk_bytes)
            pending.append((time.monotonic(), keys))
            while pending and time.monotonic() - pending[0][0] >= lag_seconds:
                conn.send(("round", _load(reader, pending.popleft()[1], chunk_bytes)))
            next_tick = max(next_tick + round_seconds, time.monotonic() - round_seconds)
    except BaseException as exc:  # reported by the bench, never silent
        with contextlib.suppress(OSError):
            conn.send(("error", repr(exc)))
    finally:
        with contextlib.suppress(OSError):
            conn.send(("not_stored", not_stored))
            conn.send(("done", None))
        writer.close()
        reader.close()


def _load(reader: EngineClient, keys: list[bytes], chunk_bytes: int) -> tuple:
    at = time.monotonic()
    reply = reader.lookup(keys, LOAD_TIMEOUT)
    t1 = time.monotonic()
    loaded, wrong = load_and_verify(reader, keys, chunk_bytes, LOAD_TIMEOUT)
    t2 = time.monotonic()
    return (at, len(keys), reply.hits, loaded - wrong, wrong, t1 - at, t2 - t1)
