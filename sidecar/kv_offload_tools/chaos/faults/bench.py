"""The pool, engines and bookkeeping every fault scenario of ``kv-offload bench chaos`` uses.

A ``ChaosBench`` runs one ``hub`` sidecar (its engine loads and verifies
chunks and keeps a durable set of its own chunks that must never be lost),
several ``server`` sidecars (their engines store the chunks the hub loads;
they are the ones killed, stopped, cut off and restarted; each dials the hub
and the other servers, so hub and servers share one chunk directory)
and one ``flood`` sidecar for the write-budget scenario, all real
``kv-offload sidecar`` processes of one LocalPool. Every chunk's bytes are
``chunk_content(key)``, so every delivered chunk is compared byte for byte.

Each scenario (``engine_faults``, ``wire_faults``) returns a ``FaultResult``:
faults injected, faults survived (nothing wrong delivered, nothing lost, the
pool recovered), loads turned into misses, corrupt chunks delivered (must be
0), chunks lost that should have survived (must be 0), the longest an engine
waited before a fetch gave up, and the store's peak bytes against its budget
where that applies.

``BenchSettings.transport`` picks the sidecars' data plane: ``tcp``, or ``nixl`` (requests on
the tcp transport's connection, chunk bytes READ one-sidedly from the holder's store slot).
The same scenarios run on both; a nixl bench also drives ``slot_faults`` (the holder's slot
bytes changed under a READ), which the byte-stream proxy cannot do there. The hand-driven
peers of the wire scenarios run on one event loop per process (``chaos.loop``: the NIXL
runtime binds to the first loop that uses it) and fetch into one probe store per bench.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.peers.handshake import HelloMessage

from kv_offload_tools.chaos import loop
from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_tools.chaos.pool import chaos_pool, require_transport

Progress = Callable[[str], None]
T = TypeVar("T")
# Seconds a restarted server has to be fetchable from the hub again.
RECOVERY_SECONDS = 30.0
# Seconds past its deadline a load or fetch may go on before it counts as hung: a safety net far
# above any give-up, never the judge of one (how a fetch ended is read from its own counter).
HUNG_AFTER_SECONDS = 30.0


@dataclass
class FaultResult:
    """The figures of one fault class."""

    # Fault class name.
    fault: str
    # Faults injected.
    injected: int = 0
    # Faults that struck an operation in flight (a kill during a load, a fault on a fetch).
    in_flight: int = 0
    # Faults after which nothing wrong was delivered, nothing lost and the pool recovered.
    survived: int = 0
    # Engine loads issued while faults were injected.
    loads: int = 0
    # Loads that returned fewer chunks than were held (recomputed by vLLM).
    loads_missed: int = 0
    # Chunks handed to an engine or made visible in a store with wrong bytes (must be 0).
    corrupt_delivered: int = 0
    # Chunks that should have survived the fault but were gone (must be 0).
    lost: int = 0
    # Chunks refused by their checksum before anyone saw them (expected under bit flips).
    integrity_rejected: int = 0
    # Longest time an engine load or peer fetch took to give up (seconds).
    worst_give_up_seconds: float = 0.0
    # Highest store bytes in use seen (flood scenario), 0 when not measured.
    store_peak_bytes: int = 0
    # The store's byte budget (--capacity-bytes), 0 when not measured.
    store_budget_bytes: int = 0
    # Wall-clock seconds of the scenario.
    seconds: float = 0.0
    # Free-form observations (one line each).
    notes: list[str] = field(default_factory=list)
    # Time series for the plot: (seconds since start, value) pairs by name.
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # Loads and fetches that gave up at their deadline and said so: the hub's sidecar answered the
    # engine's load with a miss itself (the engine's client counted no late or failed answer), or
    # the probe's client counted its fetch as a timeout (kv_offload_peer_fetches_total{result}).
    deadline_give_ups: int = 0

    @property
    def ok(self) -> bool:
        """The invariants: nothing corrupt, nothing lost, store within budget, all survived."""
        within = self.store_peak_bytes <= self.store_budget_bytes or not self.store_budget_bytes
        return (self.corrupt_delivered == 0 and self.lost == 0 and within
                and self.survived == self.injected)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("series")
        d["ok"] = self.ok
        return d

    def give_up(self, seconds: float) -> None:
        self.worst_give_up_seconds = max(self.worst_give_up_seconds, round(seconds, 4))


@dataclass(frozen=True)
class BenchSettings:
    """Shape of one chaos run."""

    # Bytes of one chunk.
    chunk_bytes: int = 64 * 1024
    # Chunks per engine load (one fetch from one server).
    chunks_per_load: int = 48
    # Server sidecars (killed and restarted in turn).
    servers: int = 3
    # Store budget of the hub and the servers (bytes).
    capacity_bytes: int = 64 << 20
    # Store budget of the flood sidecar (bytes); the flood writes 10x this.
    flood_capacity_bytes: int = 8 << 20
    # Chunks of the hub's own durable set (checked after every fault).
    durable_chunks: int = 32
    # Peer fetch deadline of every sidecar (seconds).
    fetch_deadline_seconds: float = 1.0
    # Random seed of kill timings and fault offsets.
    seed: int = 1
    # Data plane of every sidecar: "tcp" or "nixl".
    transport: str = "tcp"


class ChaosBench:
    """The pool and engines the scenarios act on."""

    def __init__(self, settings: BenchSettings, progress: Progress | None = None) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.progress = progress or (lambda line: None)
        try:
            require_transport(settings.transport)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        self.pool = chaos_pool(settings.chunk_bytes, settings.capacity_bytes,
                               fetch_deadline_seconds=settings.fetch_deadline_seconds,
                               transport=settings.transport)
        # The store the hand-driven peers fetch into (made at first use, emptied per fetch).
        self._probe_store: Any = None
        # (server, its start count, chunks) -> downstream bytes [lo, hi) of a fetch's answer
        # through the proxy (``wire_faults``, nixl).
        self.answer_bytes: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.engines: dict[str, EngineClient] = {}
        # Start count of the sidecar each engine client was made for (a restart needs a new client).
        self._engine_starts: dict[str, int] = {}
        self.batch = 0
        self.durable: list[bytes] = []
        self.server_names = [f"server-{i}" for i in range(settings.servers)]

    # ---- set-up --------------------------------------------------------------------

    def start(self) -> None:
        self.progress(f"starting {len(self.server_names) + 2} sidecars")
        self.pool.add(identity="hub", peers=[])
        for i, name in enumerate(self.server_names):
            self.pool.add(identity=name, peers=["hub", *self.server_names[:i]])
        self.pool.add(identity="flood", peers=[], capacity_bytes=self.s.flood_capacity_bytes)
        self.engines["hub"] = self.pool["hub"].client()
        self.durable = chunk_keys("hub-durable", self.s.durable_chunks)
        written = store_chunks(self.engines["hub"], self.durable, self.s.chunk_bytes)
        if written != len(self.durable):
            raise RuntimeError(f"hub stored {written} of {len(self.durable)} durable chunks")
        for name in self.server_names:
            self.wait_fetchable(name, RECOVERY_SECONDS)

    def close(self) -> None:
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                engine.close()
        self.engines.clear()
        if self._probe_store is not None:
            if self.s.transport == "nixl":
                # Registered with this process's NIXL agents for good: kept mapped (its file
                # goes with the work directory), so no later mapping can reuse its addresses.
                _REGISTERED_PROBE_STORES.append(self._probe_store)
            else:
                self._probe_store.close()
            self._probe_store = None
        self.pool.stop()

    def __enter__(self) -> ChaosBench:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ---------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of a hand-driven peer on the process's chaos loop (``chaos.loop``)."""
        return loop.run(coro)

    def data_url(self, host: str, port: int) -> str:
        """A data-plane address of this bench's transport (``tcp://`` or ``nixl://``)."""
        return f"{self.s.transport}://{host}:{port}"

    def probe_hello(self, identity: str) -> HelloMessage:
        """The hello a hand-driven peer of this pool sends (saying the bench's transport)."""
        hello = self.pool.local_hello(identity=identity)
        return dataclasses.replace(hello, transport=self.s.transport,
                                   data_address=self.data_url("127.0.0.1", 9))

    def probe_store(self, chunks: int) -> Any:
        """The hand-driven peers' ChunkStore (room for ``chunks`` chunks at least), emptied.

        One per bench rather than one per fetch: a nixl fetcher registers its store with its
        NIXL agents once and for the life of the process.
        """
        from kv_offload_sidecar.store.chunk_store import ChunkStore

        store = self._probe_store
        if store is not None and store.num_slots < chunks:
            if self.s.transport == "nixl":
                _REGISTERED_PROBE_STORES.append(store)
            else:
                store.close()
            store = None
        if store is None:
            store = self._probe_store = ChunkStore(self.s.chunk_bytes, (chunks + 1) * self.s.chunk_bytes,
                                                   directory=self.pool.workdir)
        store.drop_when_released(store.keys())
        return store

    def engine(self, name: str) -> EngineClient:
        """The engine client of a sidecar, re-created after the sidecar restarted."""
        sc = self.pool[name]
        engine = self.engines.get(name)
        if engine is None or self._engine_starts.get(name) != sc.starts:
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.close()
            engine = sc.client()
            self._engine_starts[name] = sc.starts
            self.engines[name] = engine
        return engine

    def stage_on(self, name: str, result: FaultResult) -> list[bytes] | None:
        """Store fresh chunks on server ``name`` and wait until the directory shows them to the hub.

        None (noted in ``result``) when they are not found within RECOVERY_SECONDS (a bound
        against a hang: under load the directory may take longer than usual, never that long).
        """
        keys = self.fresh_keys()
        self.put_on(name, keys)
        if not self.wait_visible(keys, RECOVERY_SECONDS):
            result.notes.append(f"{name}: chunks not in the directory in {RECOVERY_SECONDS:.0f} s; skipped")
            return None
        return keys

    def staged_rounds(self, rounds: int, result: FaultResult) -> Iterator[tuple[int, str, list[bytes]]]:
        """(round, server, keys) per round: the servers in turn, each holding fresh chunks the
        directory shows the hub (a round whose chunks are not found is skipped, noted)."""
        for r in range(rounds):
            name = self.server_names[r % len(self.server_names)]
            keys = self.stage_on(name, result)
            if keys is not None:
                yield r, name, keys

    def fresh_keys(self, n: int | None = None) -> list[bytes]:
        self.batch += 1
        return chunk_keys(f"batch-{self.batch}", n or self.s.chunks_per_load)

    def put_on(self, name: str, keys: list[bytes]) -> None:
        """Store ``keys`` on a server through its engine."""
        n = store_chunks(self.engine(name), keys, self.s.chunk_bytes)
        if n != len(keys):
            raise RuntimeError(f"{name} stored {n} of {len(keys)} chunks")

    def wait_visible(self, keys: list[bytes], timeout: float) -> bool:
        """Until the pool's directory tells the hub a peer holds all ``keys`` (asked with the
        admin lookup, which moves nothing: the loads after it still fetch)."""
        end = time.monotonic() + timeout
        hub = self.pool["hub"]
        while time.monotonic() < end:
            with contextlib.suppress(OSError, RuntimeError):
                if hub.hits(keys, timeout=self.s.fetch_deadline_seconds + 2.0) >= len(keys):
                    return True
            time.sleep(0.05)
        return False

    def wait_fetchable(self, name: str, timeout: float) -> float:
        """Store a probe batch on ``name`` and wait until the hub loads it; returns seconds."""
        started = time.monotonic()
        end = started + timeout
        keys = self.fresh_keys(2)
        while time.monotonic() < end:
            with contextlib.suppress(Exception):
                self.put_on(name, keys)
                break
            time.sleep(0.2)
        while time.monotonic() < end:
            if self.wait_visible(keys, min(2.0, max(0.1, end - time.monotonic()))):
                n, bad = load_and_verify(self.engines["hub"], keys, self.s.chunk_bytes,
                                         self.s.fetch_deadline_seconds)
                if bad:
                    raise AssertionError(f"hub read {bad} corrupt chunks from {name}")
                if n == len(keys):
                    return time.monotonic() - started
            time.sleep(0.1)
        raise TimeoutError(f"hub could not load from {name} within {timeout}s")

    def check_durable(self, result: FaultResult) -> None:
        """The hub's own chunks are all there and right (they had no reason to go)."""
        n, bad = load_and_verify(self.engines["hub"], self.durable, self.s.chunk_bytes, 5.0)
        result.lost += len(self.durable) - n
        result.corrupt_delivered += bad

    def durable_intact(self, result: FaultResult) -> bool:
        """``check_durable``, True when it found no wrong byte and nothing lost (so far)."""
        bad_before = result.corrupt_delivered
        self.check_durable(result)
        return result.corrupt_delivered == bad_before and result.lost == 0

    def timed_load(self, keys: list[bytes], result: FaultResult) -> tuple[int, float]:
        """One hub load of ``keys`` with verification; returns (chunks read, seconds)."""
        started = time.monotonic()
        n, bad = load_and_verify(self.engines["hub"], keys, self.s.chunk_bytes,
                                 self.s.fetch_deadline_seconds)
        took = time.monotonic() - started
        result.loads += 1
        result.corrupt_delivered += bad
        if n < len(keys):
            result.loads_missed += 1
            result.give_up(took)
        return n, took

    def retire_engine(self, name: str, engine: EngineClient) -> None:
        """Hand back a client kept across a restart: it is closed and replaced on the next ``engine``."""
        self.engines[name] = engine
        self._engine_starts[name] = -1

    def restart(self, name: str) -> None:
        """SIGKILL server ``name`` (stopped or not) and start it again under its name; it dials
        the hub and every other server (as a restarted pod dials the pool it resolves)."""
        sc = self.pool[name]
        sc.send(signal.SIGCONT)
        sc.kill()
        self.pool.set_peers(name, ["hub", *(n for n in self.server_names if n != name)])
        sc.start()


# Probe stores a nixl bench registered with this process's NIXL agents (never unmapped).
_REGISTERED_PROBE_STORES: list[Any] = []
