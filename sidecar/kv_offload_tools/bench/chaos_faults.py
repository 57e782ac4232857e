"""The fault scenarios of ``kv-offload bench chaos``, each one bounded and self-checking.

A ``ChaosBench`` runs one ``hub`` sidecar (its engine loads and verifies
chunks and keeps a durable set of its own chunks that must never be lost),
several ``server`` sidecars (their engines store the chunks the hub loads;
they are the ones killed, stopped, cut off and restarted) and one ``flood``
sidecar for the write-budget scenario, all real ``kv-offload sidecar``
processes on 127.0.0.1. Every chunk's bytes are ``chunk_content(key)``, so
every delivered chunk is compared byte for byte.

Each scenario returns a ``FaultResult``: faults injected, faults survived
(nothing wrong delivered, nothing lost, the pool recovered), loads turned
into misses, corrupt chunks delivered (must be 0), chunks lost that should
have survived (must be 0), the longest an engine waited before a fetch gave
up, and the store's peak bytes against its budget where that applies.

Faults on the wire (flipped, truncated, delayed bytes) run through
``FaultProxy`` between a hand-driven peer (a real handshake with the pool
key, the real ``transport.connect`` client and a real ``ChunkStore``, i.e.
the receiving half of a sidecar) and a server sidecar's data port: a sidecar
advertises only its own data address, so a proxy cannot be slipped between
two sidecar processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.store.chunk_store import ChunkStore

from kv_offload_tools.bench.chaos_support import (
    ChaosPool,
    SidecarProcess,
    chunk_content,
    chunk_keys,
    load_and_verify,
    probe_handshake,
    store_chunks,
)
from kv_offload_tools.bench.fault_proxy import FaultPlan, FaultProxy

Progress = Callable[[str], None]
# Seconds a restarted server has to be fetchable from the hub again.
RECOVERY_SECONDS = 30.0
# Seconds an engine load may take beyond the fetch deadline before it counts as a hang.
GIVE_UP_SLACK_SECONDS = 1.5


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


class ChaosBench:
    """The pool and engines the scenarios act on."""

    def __init__(self, settings: BenchSettings, progress: Progress | None = None) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.progress = progress or (lambda line: None)
        self.pool = ChaosPool(chunk_bytes=settings.chunk_bytes, capacity_bytes=settings.capacity_bytes,
                              fetch_deadline_seconds=settings.fetch_deadline_seconds)
        self.engines: dict[str, EngineClient] = {}
        # Start count of the sidecar each engine client was made for (a restart needs a new client).
        self._engine_starts: dict[str, int] = {}
        self.batch = 0
        self.durable: list[bytes] = []
        self.server_names = [f"server-{i}" for i in range(settings.servers)]

    # ---- set-up --------------------------------------------------------------------

    def start(self) -> None:
        self.progress(f"starting {len(self.server_names) + 2} sidecars")
        self.pool.add("hub")
        for name in self.server_names:
            self.pool.add(name, peers=["hub"])
        self.pool.add("flood", capacity_bytes=self.s.flood_capacity_bytes)
        self.engines["hub"] = self.pool["hub"].engine()
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
        self.pool.close()

    def __enter__(self) -> ChaosBench:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ---------------------------------------------------------------

    def engine(self, name: str) -> EngineClient:
        """The engine client of a sidecar, re-created after the sidecar restarted."""
        sc = self.pool[name]
        engine = self.engines.get(name)
        if engine is None or self._engine_starts.get(name) != sc.starts:
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.close()
            engine = sc.engine()
            self._engine_starts[name] = sc.starts
            self.engines[name] = engine
        return engine

    def stage_on(self, name: str, result: FaultResult) -> list[bytes] | None:
        """Store fresh chunks on server ``name`` and wait until the hub's summaries show them.

        None (noted in ``result``) when the summary does not arrive in 5 s.
        """
        keys = self.fresh_keys()
        self.put_on(name, keys)
        if not self.wait_visible(keys, 5.0):
            result.notes.append(f"{name}: summary not seen in 5 s; skipped")
            return None
        return keys

    def fresh_keys(self, n: int | None = None) -> list[bytes]:
        self.batch += 1
        return chunk_keys(f"batch-{self.batch}", n or self.s.chunks_per_load)

    def put_on(self, name: str, keys: list[bytes]) -> None:
        """Store ``keys`` on a server through its engine."""
        n = store_chunks(self.engine(name), keys, self.s.chunk_bytes)
        if n != len(keys):
            raise RuntimeError(f"{name} stored {n} of {len(keys)} chunks")

    def wait_visible(self, keys: list[bytes], timeout: float) -> bool:
        """Until the hub's summaries say a peer holds all ``keys``."""
        end = time.monotonic() + timeout
        hub = self.engines["hub"]
        while time.monotonic() < end:
            reply = hub.lookup(keys, timeout=self.s.fetch_deadline_seconds)
            if reply.hits >= len(keys):
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

    def restart(self, name: str) -> None:
        sc = self.pool[name]
        sc.send(signal.SIGCONT)
        sc.kill()
        sc.start()

    # ---- scenarios -------------------------------------------------------------------

    def sigkill_mid_fetch(self, kills: int, seconds: float) -> FaultResult:
        """SIGKILL the serving peer while the hub's engine loads from it; restart; repeat."""
        result = FaultResult("sigkill_mid_fetch")
        started = time.monotonic()
        landed = 0
        durations: list[float] = []
        restarting: dict[str, threading.Thread] = {}
        idx = 0
        while landed < kills and time.monotonic() - started < seconds:
            name = self.server_names[idx % len(self.server_names)]
            idx += 1
            t = restarting.pop(name, None)
            if t is not None:
                t.join()
                with contextlib.suppress(TimeoutError):
                    self.wait_fetchable(name, RECOVERY_SECONDS)
            keys = self.stage_on(name, result)
            if keys is None:
                continue
            if len(durations) < 3:  # calibrate: how long an undisturbed fetch takes (no verification)
                t0 = time.monotonic()
                self.engines["hub"].load(keys, lambda i, view: None, self.s.fetch_deadline_seconds)
                durations.append(time.monotonic() - t0)
                continue
            delay = self.rng.uniform(0.0, 0.7 * sorted(durations)[len(durations) // 2])
            out: dict[str, Any] = {}

            def load(keys: list[bytes] = keys, out: dict[str, Any] = out) -> None:
                out["t0"] = time.monotonic()
                out["n"], out["took"] = self.timed_load(keys, result)
                out["t1"] = time.monotonic()

            loader = threading.Thread(target=load)
            loader.start()
            time.sleep(delay)
            killed_at = time.monotonic()
            self.pool[name].kill()
            result.injected += 1
            loader.join(self.s.fetch_deadline_seconds + 30)
            mid = bool(out) and out["t0"] <= killed_at <= out["t1"] and out["n"] < len(keys)
            landed += mid
            bad_before = result.corrupt_delivered
            hung = not out or out["took"] > self.s.fetch_deadline_seconds + GIVE_UP_SLACK_SECONDS + 5
            self.check_durable(result)
            if not hung and result.corrupt_delivered == bad_before and result.lost == 0:
                result.survived += 1
            restarting[name] = threading.Thread(target=self.restart, args=(name,))
            restarting[name].start()
            if result.injected % 10 == 0:
                self.progress(f"sigkill_mid_fetch: {result.injected} kills, {landed} mid-fetch, "
                              f"{result.loads_missed} loads missed, {result.corrupt_delivered} corrupt")
        for name, t in restarting.items():
            t.join()
            try:
                self.wait_fetchable(name, RECOVERY_SECONDS)
            except TimeoutError as exc:
                result.survived -= 1
                result.notes.append(f"{name} did not recover: {exc}")
        result.in_flight = landed
        result.notes.append(f"{landed} of {result.injected} kills landed while a load was in flight "
                            f"and cut it short (undisturbed fetch of {self.s.chunks_per_load} chunks: "
                            f"{1000 * sorted(durations)[len(durations) // 2]:.1f} ms)")
        result.series["mid_fetch_kills"] = [(0.0, float(landed))]
        result.seconds = round(time.monotonic() - started, 2)
        return result

    def sigstop_past_deadline(self, rounds: int) -> FaultResult:
        """SIGSTOP the serving peer; the hub's load must give up at the deadline; SIGCONT; recover."""
        result = FaultResult("sigstop_past_deadline")
        started = time.monotonic()
        for r in range(rounds):
            name = self.server_names[r % len(self.server_names)]
            keys = self.stage_on(name, result)
            if keys is None:
                continue
            sc = self.pool[name]
            sc.send(signal.SIGSTOP)
            result.injected += 1
            result.in_flight += 1
            try:
                n, took = self.timed_load(keys, result)
                time.sleep(self.s.fetch_deadline_seconds)  # stopped well past the deadline
            finally:
                sc.send(signal.SIGCONT)
            bad_before = result.corrupt_delivered
            self.check_durable(result)
            try:
                recovery = self.wait_fetchable(name, RECOVERY_SECONDS)
                result.series.setdefault("recovery_seconds", []).append((float(r), recovery))
                if took <= self.s.fetch_deadline_seconds + GIVE_UP_SLACK_SECONDS and \
                        result.corrupt_delivered == bad_before and result.lost == 0:
                    result.survived += 1
            except TimeoutError as exc:
                result.notes.append(str(exc))
        result.seconds = round(time.monotonic() - started, 2)
        self.progress(f"sigstop_past_deadline: {result.injected} stops, worst give-up "
                      f"{result.worst_give_up_seconds:.3f} s")
        return result

    def wire_faults(self, mode: str, rounds: int) -> FaultResult:
        """Flip, truncate or delay the bytes of fetches from a server through ``FaultProxy``."""
        return asyncio.run(self._wire_faults(mode, rounds))

    async def _probe_fetch(self, sc: SidecarProcess, keys: list[bytes], plan: FaultPlan, tag: str,
                           on_fault: Callable[[FaultPlan], None] | None = None
                           ) -> tuple[int, float, int, int]:
        """One fetch by a hand-driven peer through the proxy into its own store.

        Returns (leading chunks fetched or -1 on error, seconds, visible chunks with
        wrong bytes, chunks refused by checksum).
        """
        from kv_offload_sidecar.data import TransportError, connect

        deadline = self.s.fetch_deadline_seconds
        probe = await asyncio.to_thread(probe_handshake, sc.control_address, self.pool.pool_key,
                                        self.pool.local_hello(identity=f"probe-{tag}"))
        host, _, port = probe.server_hello.data_address.removeprefix("tcp://").rpartition(":")
        store = ChunkStore(self.s.chunk_bytes, (len(keys) + 1) * self.s.chunk_bytes,
                           directory=self.pool.shm_dir, name=f"probe-{tag}")
        try:
            async with FaultProxy(host, int(port), plan=plan, on_fault=on_fault) as proxy:
                client = await connect(proxy.address, probe.session.session_id,
                                       probe.session.session_key, timeout=deadline)
                t0 = time.monotonic()
                try:
                    got = await client.fetch(keys, store, deadline)
                except TransportError:
                    got = -1
                took = time.monotonic() - t0
                await client.close()
            bad = 0
            for key in store.keys():  # every chunk that became visible must be right
                pin = store.pin(key)
                if pin is not None:
                    with pin:
                        bad += pin.view != chunk_content(key, self.s.chunk_bytes)
            return got, took, bad, int(store.stats().get("integrity_failures", 0))
        finally:
            store.close()

    async def _wire_faults(self, mode: str, rounds: int) -> FaultResult:
        result = FaultResult(f"wire_{mode}")
        started = time.monotonic()
        name = self.server_names[0]
        sc = self.pool[name]
        keys = self.fresh_keys()
        await asyncio.to_thread(self.put_on, name, keys)
        total = len(keys) * self.s.chunk_bytes
        deadline = self.s.fetch_deadline_seconds
        for r in range(rounds):
            if mode == "flip":
                plan = FaultPlan("flip", after_bytes=self.rng.randrange(0, total), flip_every=total)
            elif mode == "truncate":
                plan = FaultPlan("truncate", after_bytes=self.rng.randrange(0, total))
            else:
                plan = FaultPlan("delay", after_bytes=self.rng.randrange(0, total // 2),
                                 delay_seconds=deadline / 4)
            got, took, bad, refused = await self._probe_fetch(sc, keys, plan, f"{mode}-{r}")
            result.injected += 1
            result.in_flight += 1
            result.loads += 1
            if got < len(keys):
                result.loads_missed += 1
                result.give_up(took)
            result.corrupt_delivered += bad
            result.integrity_rejected += refused
            if bad == 0 and sc.alive and took <= deadline + GIVE_UP_SLACK_SECONDS:
                result.survived += 1
        hub_bad_before = result.corrupt_delivered
        await asyncio.to_thread(self.check_durable, result)
        if result.corrupt_delivered != hub_bad_before or result.lost:
            result.survived = 0
        result.seconds = round(time.monotonic() - started, 2)
        self.progress(f"wire_{mode}: {result.injected} faults, {result.integrity_rejected} chunks "
                      f"refused by checksum, {result.corrupt_delivered} corrupt")
        return result

    def sigkill_on_wire(self, rounds: int) -> FaultResult:
        """SIGKILL a server at an exact byte of a fetch from it (the proxy cuts the wire there too)."""
        return asyncio.run(self._sigkill_on_wire(rounds))

    async def _sigkill_on_wire(self, rounds: int) -> FaultResult:
        result = FaultResult("sigkill_at_byte")
        started = time.monotonic()
        restarting: dict[str, asyncio.Task[None]] = {}
        for r in range(rounds):
            name = self.server_names[r % len(self.server_names)]
            if name in restarting:
                await restarting.pop(name)
            sc = self.pool[name]
            keys = self.fresh_keys()
            await asyncio.to_thread(self.put_on, name, keys)
            total = len(keys) * self.s.chunk_bytes
            plan = FaultPlan("truncate", after_bytes=self.rng.randrange(self.s.chunk_bytes // 2,
                                                                         total - self.s.chunk_bytes))

            def kill(_: FaultPlan, sc: SidecarProcess = sc) -> None:
                sc.send(signal.SIGKILL)

            got, took, bad, _ = await self._probe_fetch(sc, keys, plan, f"kill-{r}", on_fault=kill)
            result.injected += 1
            result.loads += 1
            result.corrupt_delivered += bad
            if got < len(keys):
                result.in_flight += 1
                result.loads_missed += 1
                result.give_up(took)
            if bad == 0 and took <= self.s.fetch_deadline_seconds + GIVE_UP_SLACK_SECONDS:
                result.survived += 1
            restarting[name] = asyncio.create_task(asyncio.to_thread(self.restart, name))
            if (r + 1) % 5 == 0:
                self.progress(f"sigkill_at_byte: {r + 1}/{rounds} kills, {result.corrupt_delivered} corrupt")
        for name, task in restarting.items():  # every killed server comes back and serves the hub
            await task
            try:
                await asyncio.to_thread(self.wait_fetchable, name, RECOVERY_SECONDS)
            except TimeoutError as exc:
                result.survived = 0
                result.notes.append(str(exc))
        bad_before = result.corrupt_delivered
        await asyncio.to_thread(self.check_durable, result)
        if result.corrupt_delivered != bad_before or result.lost:
            result.survived = 0
        result.seconds = round(time.monotonic() - started, 2)
        self.progress(f"sigkill_at_byte: {result.injected} kills at a random byte of a fetch, "
                      f"{result.corrupt_delivered} corrupt")
        return result

    def reconnect_storm(self, rounds: int, probes: int = 16) -> FaultResult:
        """Kill every server at once and restart them together, while probes reconnect and drop."""
        return asyncio.run(self._reconnect_storm(rounds, probes))

    async def _reconnect_storm(self, rounds: int, probes: int) -> FaultResult:
        from kv_offload_sidecar.data import connect

        result = FaultResult("reconnect_storm")
        started = time.monotonic()
        hub = self.pool["hub"]
        data = hub.status()["data_address"].removeprefix("tcp://")
        host, _, port = data.rpartition(":")
        async with FaultProxy(host, int(port)) as proxy:
            for r in range(rounds):
                result.injected += 1
                clients = []
                for i in range(probes):  # many peers handshake and connect at once ...
                    probe = await asyncio.to_thread(
                        probe_handshake, hub.control_address, self.pool.pool_key,
                        self.pool.local_hello(identity=f"storm-{r}-{i}"))
                    clients.append(connect(proxy.address, probe.session.session_id,
                                           probe.session.session_key, timeout=5.0))
                conns = await asyncio.gather(*clients, return_exceptions=True)
                for name in self.server_names:  # ... every server dies at once ...
                    self.pool[name].kill()
                proxy.reset_all()  # ... and every probe connection drops
                for c in conns:
                    if not isinstance(c, BaseException):
                        with contextlib.suppress(Exception):
                            await c.close()
                keys_by: dict[str, list[bytes]] = {}
                await asyncio.gather(*(asyncio.to_thread(self.pool[n].start) for n in self.server_names))
                t0 = time.monotonic()
                recovered = True
                for name in self.server_names:
                    try:
                        await asyncio.to_thread(self.wait_fetchable, name, RECOVERY_SECONDS)
                    except TimeoutError as exc:
                        recovered = False
                        result.notes.append(str(exc))
                    keys_by[name] = self.fresh_keys(8)
                recovery = time.monotonic() - t0
                result.series.setdefault("recovery_seconds", []).append((float(r), recovery))
                bad_before = result.corrupt_delivered
                for name, keys in keys_by.items():
                    await asyncio.to_thread(self.put_on, name, keys)
                    if await asyncio.to_thread(self.wait_visible, keys, 5.0):
                        await asyncio.to_thread(self.timed_load, keys, result)
                await asyncio.to_thread(self.check_durable, result)
                if recovered and result.corrupt_delivered == bad_before and result.lost == 0 \
                        and hub.alive:
                    result.survived += 1
                self.progress(f"reconnect_storm: round {r + 1}/{rounds} recovered in {recovery:.2f} s")
        result.seconds = round(time.monotonic() - started, 2)
        return result

    def discovery_churn(self, rounds: int) -> FaultResult:
        """A server leaves (SIGTERM) while the hub loads its chunks, then rejoins under its name."""
        result = FaultResult("leave_and_rejoin")
        started = time.monotonic()
        for r in range(rounds):
            name = self.server_names[r % len(self.server_names)]
            keys = self.stage_on(name, result)
            if keys is None:
                continue
            sc = self.pool[name]
            result.injected += 1
            code = sc.terminate(30)
            if code != 0:
                result.notes.append(f"{name} exited {code} on SIGTERM")
            n, _ = self.timed_load(keys, result)  # gone: a miss, promptly
            bad_before = result.corrupt_delivered
            sc.start()
            try:
                recovery = self.wait_fetchable(name, RECOVERY_SECONDS)
                result.series.setdefault("recovery_seconds", []).append((float(r), recovery))
                self.check_durable(result)
                if code == 0 and result.corrupt_delivered == bad_before and result.lost == 0:
                    result.survived += 1
            except TimeoutError as exc:
                result.notes.append(str(exc))
        result.seconds = round(time.monotonic() - started, 2)
        self.progress(f"leave_and_rejoin: {result.injected} rounds, {result.survived} rejoined")
        return result

    def restart_under_engine(self, rounds: int) -> FaultResult:
        """A server's sidecar restarts while its engine keeps its client (vLLM keeps running).

        The engine goes on storing through the client it had; whatever it stores
        after the restart must reach the new sidecar's store intact (or be refused),
        and the hub must never load a wrong byte of it.
        """
        result = FaultResult("restart_under_engine")
        started = time.monotonic()
        for r in range(rounds):
            name = self.server_names[r % len(self.server_names)]
            engine = self.engine(name)  # kept across the restart
            self.restart(name)
            result.injected += 1
            keys = self.fresh_keys(8)
            written = 0
            for _ in range(3):  # the first call may find the old connection dead
                written = store_chunks(engine, keys, self.s.chunk_bytes)
                if written:
                    break
            bad_before = result.corrupt_delivered
            if written and self.wait_visible(keys, 5.0):
                self.timed_load(keys, result)  # the hub fetches them from the restarted sidecar
            got, bad = load_and_verify(engine, keys, self.s.chunk_bytes, 5.0)
            result.loads += 1
            result.corrupt_delivered += bad
            self.engines[name] = engine
            self._engine_starts[name] = -1  # re-created on next use
            with contextlib.suppress(TimeoutError):
                self.wait_fetchable(name, RECOVERY_SECONDS)
            self.check_durable(result)
            if result.corrupt_delivered == bad_before and result.lost == 0:
                result.survived += 1
        if result.corrupt_delivered:
            result.notes.append("EngineClient keeps the unlinked store file of the old sidecar mapped: "
                                "chunks it writes after a restart are committed with the new "
                                "store's stale slot bytes")
        result.seconds = round(time.monotonic() - started, 2)
        self.progress(f"restart_under_engine: {result.injected} restarts, "
                      f"{result.corrupt_delivered} corrupt chunks delivered")
        return result

    def write_flood(self, factor: int = 10) -> FaultResult:
        """Write ``factor`` x the flood sidecar's budget while loading recent chunks back."""
        result = FaultResult("write_flood_10x" if factor == 10 else f"write_flood_{factor}x")
        started = time.monotonic()
        sc = self.pool["flood"]
        budget = self.s.flood_capacity_bytes
        result.store_budget_bytes = budget
        stop = threading.Event()
        samples: list[tuple[float, float]] = []

        def sample() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    used = sc.status(timeout=2.0)["store"]["used_bytes"]
                    samples.append((time.monotonic() - started, float(used)))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        engine = self.engine("flood")
        batch = max(1, min(self.s.chunks_per_load, budget // self.s.chunk_bytes // 4))
        target = factor * budget
        written = 0
        try:
            while written < target:
                keys = self.fresh_keys(batch)
                n = store_chunks(engine, keys, self.s.chunk_bytes)
                written += n * self.s.chunk_bytes
                result.injected += 1
                got, bad = load_and_verify(engine, keys, self.s.chunk_bytes, 5.0)
                result.loads += 1
                result.corrupt_delivered += bad
                # The batch just written fits the budget many times over: LRU must keep it.
                result.lost += n - got
                if got < len(keys):
                    result.loads_missed += 1
                if bad == 0 and got == n == len(keys):
                    result.survived += 1
        finally:
            stop.set()
            sampler.join(5)
        status = sc.status()
        file_bytes = status["store"]["num_slots"] * status["store"]["slot_stride"]
        peak = max([v for _, v in samples] + [float(status["store"]["used_bytes"])])
        result.store_peak_bytes = int(peak)
        metrics = sc.metrics()
        evictions = int(metrics.get("kv_offload_evictions_total", 0))
        result.notes.append(f"wrote {written / 2**20:.0f} MiB into a {budget / 2**20:.0f} MiB store "
                            f"({evictions} evictions, {len(samples)} samples of used bytes; "
                            f"shared-memory file {file_bytes} bytes)")
        if file_bytes > budget:
            result.notes.append(f"store file of {file_bytes} bytes exceeds the budget")
            result.store_peak_bytes = max(result.store_peak_bytes, file_bytes)
        result.series["store_used_bytes"] = samples
        result.seconds = round(time.monotonic() - started, 2)
        self.progress(f"write_flood: {written / 2**20:.0f} MiB written, peak "
                      f"{peak / 2**20:.2f} MiB of {budget / 2**20:.0f} MiB")
        return result
