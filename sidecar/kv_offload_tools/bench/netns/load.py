"""The engine load of ``kv-offload bench netns``: pods store fresh chunks, other pods read them.

Every pod's engine is an EngineClient made inside the pod's namespace (``NetnsPool.client``),
so its requests are the pod's own. Each holder's storer thread stores ``chunks_per_batch``
new chunks every ``round_seconds`` (``chaos.chunks``: bytes a function of the key) and hands
the batch to the next reader in turn (never itself); each reader's thread, once a batch is
``lag_seconds`` old (time for the chunk directory to learn it), looks the keys up and loads
the hits, verifying every byte. A ``Request`` is one such lookup + load: who read, whose
chunks, how many hit and how long the engine waited; the bench cuts them into windows by
their start time. A chunk is read once, by one reader, so every read is a fresh peer hit or
a miss (never a copy the reader kept).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_offload_sidecar.engine.client import EngineClient

from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_tools.netns.pool import NetnsPool


@dataclass(frozen=True)
class Request:
    """One reader's lookup + load of a batch another pod stored."""

    # time.monotonic() when the lookup began.
    at: float
    reader: int
    holder: int
    asked: int
    # Chunks the lookup said it holds, chunks delivered right, delivered wrong.
    looked_up: int
    loaded: int
    wrong: int
    # Seconds the engine waited: lookup, then load.
    seconds: float


@dataclass(eq=False)
class PoolLoad:
    """Storer threads of ``holders`` and reader threads of ``readers`` (pod indices); ``start``/``stop``."""

    pool: NetnsPool
    # Pods whose storer threads store batches, and pods whose reader threads read them.
    holders: Sequence[int]
    readers: Sequence[int]
    # Prefix of the chunk keys (each load stores chunks of its own).
    tag: str
    # New chunks of one batch, and seconds between a holder's batches.
    chunks_per_batch: int = 4
    round_seconds: float = 0.1
    # Seconds a batch waits before it is read (time for the chunk directory to learn it).
    lag_seconds: float = 1.0
    # Deadline of one lookup (seconds).
    lookup_timeout: float = 3.0
    # Every lookup + load the readers made.
    requests: list[Request] = field(default_factory=list, init=False)
    # Batches a holder could not store whole (its own sidecar refused).
    not_stored: int = field(default=0, init=False)
    # What ended a storer or reader thread early ("pod N: exception").
    errors: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.holders, self.readers = tuple(self.holders), tuple(self.readers)
        self._inbox: dict[int, collections.deque[tuple[float, int, list[bytes]]]] = {
            r: collections.deque() for r in self.readers}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: list[EngineClient] = []

    def start(self) -> "PoolLoad":
        for h in self.holders:
            self._spawn(f"kvn-store-{h}", self._store_loop, h)
        for r in self.readers:
            self._spawn(f"kvn-read-{r}", self._read_loop, r)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()

    def __enter__(self) -> "PoolLoad":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def window(self, t0: float, t1: float) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if t0 <= r.at < t1]

    def _spawn(self, name: str, loop: object, pod: int) -> None:
        client = self.pool.client(pod, timeout=self.lookup_timeout + 2)
        self._clients.append(client)
        t = threading.Thread(target=self._guard, args=(loop, client, pod), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, loop: object, client: EngineClient, pod: int) -> None:
        try:
            loop(client, pod)  # type: ignore[operator]
        except Exception as exc:  # reported by the bench, never silent
            self.errors.append(f"pod {pod}: {exc!r}")

    def _store_loop(self, client: EngineClient, holder: int) -> None:
        others = [r for r in self.readers if r != holder]
        n = 0
        tick = time.monotonic()
        while not self._stop.wait(max(0.0, tick - time.monotonic())):
            keys = chunk_keys(f"{self.tag}/{holder}/{n}", self.chunks_per_batch)
            if store_chunks(client, keys, self.pool.chunk_bytes) != len(keys):
                self.not_stored += 1
            else:
                with self._lock:
                    self._inbox[others[n % len(others)]].append((time.monotonic(), holder, keys))
            n += 1
            tick = max(tick + self.round_seconds, time.monotonic() - self.round_seconds)

    def _read_loop(self, client: EngineClient, reader: int) -> None:
        inbox = self._inbox[reader]
        while not self._stop.is_set():
            with self._lock:
                due = inbox.popleft() if inbox and time.monotonic() - inbox[0][0] >= self.lag_seconds else None
            if due is None:
                self._stop.wait(0.01)
                continue
            _, holder, keys = due
            t0 = time.monotonic()
            hit = client.lookup(keys, self.lookup_timeout).hits
            loaded, wrong = load_and_verify(client, keys[:hit], self.pool.chunk_bytes,
                                            self.lookup_timeout) if hit else (0, 0)
            with self._lock:
                self.requests.append(Request(t0, reader, holder, len(keys), hit, loaded, wrong,
                                             time.monotonic() - t0))
