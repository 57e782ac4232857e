"""Fault scenarios on the wire: a hand-driven peer fetches through ``FaultProxy``.

The peer is the receiving half of a sidecar: a real handshake with the pool
key, the runtime's own data-plane client and a real ``ChunkStore``. A sidecar
advertises only its own data address, so a proxy cannot be slipped between
two sidecar processes; it sits between this peer and a server's data port,
where it flips, truncates or delays bytes, or marks the byte at which the
server is killed. Each scenario returns a ``FaultResult``.

On the nixl transport the proxy sits on the request connection only (``nixl://`` to the
proxy; authentication, the sealed NIXL metadata, FETCH and the CHUNK_AT answers: key,
checksum and slot of each chunk); the chunk bytes are READ from the holder's memory and
never cross it. The fault bytes are then drawn from the CHUNK_AT answers of a fetch
(measured per server start by an undisturbed fetch through the proxy): a flipped byte lands
in a header, a key, a checksum or a slot number; a slot number pointing elsewhere makes the
READ fetch another slot's bytes, which the checksum refuses. Damaging the chunk bytes
themselves is ``slot_faults``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_offload_tools.chaos.chunks import chunk_content
from kv_offload_tools.chaos.fault_proxy import FaultPlan, FaultProxy
from kv_offload_tools.chaos.faults.bench import (
    HUNG_AFTER_SECONDS,
    RECOVERY_SECONDS,
    ChaosBench,
    FaultResult,
)
from kv_offload_tools.chaos.probes import probe_handshake
from kv_offload_testing.sidecar_process import SidecarProcess


def damaged_wire(bench: ChaosBench, mode: str, rounds: int) -> FaultResult:
    """Flip, truncate or delay the bytes of fetches from a server through ``FaultProxy``."""
    return bench.run(_damaged_wire(bench, mode, rounds))


@dataclass(frozen=True)
class ProbeFetch:
    """What one fetch by a hand-driven peer through the proxy gave."""

    # Leading chunks fetched, or -1 when the connection or the fetch failed.
    got: int
    # Seconds the fetch took (to its end or its failure).
    took: float
    # Chunks that became visible in the peer's store with wrong bytes (must be 0).
    bad: int
    # Chunks refused by their checksum.
    refused: int
    # Bytes the proxy forwarded downstream once the connection was open (authenticated).
    connect_bytes: int
    # Bytes it forwarded downstream in all.
    total_bytes: int
    # How the fetch ended, as the peer's client counted it (a result of
    # kv_offload_peer_fetches_total: "ok", "miss", "timeout", "error", "integrity"), "unconnected"
    # when the connection never opened, "hung" when it outlived its deadline by HUNG_AFTER_SECONDS.
    outcome: str


def _host_port(address: str) -> tuple[str, int]:
    """(host, port) of a data-plane address of any scheme."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return host.strip("[]"), int(port)


async def _probe_fetch(bench: ChaosBench, sc: SidecarProcess, keys: list[bytes], plan: FaultPlan, tag: str,
                       on_fault: Callable[[FaultPlan], None] | None = None) -> ProbeFetch:
    """One fetch by a hand-driven peer through the proxy into its own store."""
    from kv_offload_sidecar.data import TransportError, connect
    from kv_offload_sidecar.metrics import FETCH_RESULTS, SidecarMetrics
    from prometheus_client import CollectorRegistry

    deadline = bench.s.fetch_deadline_seconds
    metrics = SidecarMetrics(CollectorRegistry())
    probe = await asyncio.to_thread(probe_handshake, sc, bench.pool.pool_key, bench.probe_hello(f"probe-{tag}"))
    host, port = _host_port(probe.server_hello.data_address)
    store = bench.probe_store(len(keys))
    refused_before = int(store.stats().get("integrity_failures", 0))
    connect_bytes = 0
    async with FaultProxy(host, port, plan=plan, on_fault=on_fault) as proxy:
        t0 = time.monotonic()
        outcome = "unconnected"
        try:
            client = await connect(bench.data_url(proxy.host, proxy.port), probe.session.session_id,
                                   probe.session.session_key, timeout=deadline, metrics=metrics)
        except TransportError:  # the fault struck before the connection was open
            got, took = -1, time.monotonic() - t0
        else:
            connect_bytes = proxy.bytes_downstream
            t0 = time.monotonic()
            try:
                got = await asyncio.wait_for(client.fetch(keys, store, deadline), deadline + HUNG_AFTER_SECONDS)
            except TransportError:
                got = -1
            except TimeoutError:
                got, outcome = -1, "hung"
            took = time.monotonic() - t0
            await client.close()
            counted = [r for r in FETCH_RESULTS
                       if metrics.registry.get_sample_value("kv_offload_peer_fetches_total", {"result": r})]
            if outcome != "hung":
                outcome = counted[0] if len(counted) == 1 else f"counted {counted}"
        total_bytes = proxy.bytes_downstream
    bad = 0
    for key in store.keys():  # every chunk that became visible must be right
        pin = store.pin(key)
        if pin is not None:
            with pin:
                bad += pin.view != chunk_content(key, bench.s.chunk_bytes)
    refused = int(store.stats().get("integrity_failures", 0)) - refused_before
    return ProbeFetch(got, took, bad, refused, connect_bytes, total_bytes, outcome)


async def _answer_bytes(bench: ChaosBench, sc: SidecarProcess, keys: list[bytes], tag: str) -> tuple[int, int]:
    """The downstream byte range [lo, hi) that carries the answer to a fetch of ``keys``.

    tcp: the chunk bytes (the handshake's few bytes before them are left in, as always).
    nixl: the CHUNK_AT frames, measured by an undisturbed fetch through the proxy, once per
    start of the server (its NIXL metadata, hence the bytes before them, may change length).
    """
    if bench.s.transport == "tcp":
        return 0, len(keys) * bench.s.chunk_bytes
    cache = bench.answer_bytes
    slot = (sc.identity, sc.starts, len(keys))
    if slot not in cache:
        out = await _probe_fetch(bench, sc, keys, FaultPlan("pass"), f"{tag}-measure")
        if out.got != len(keys) or out.bad:
            raise RuntimeError(f"an undisturbed fetch of {len(keys)} chunks from {sc.identity} through "
                               f"the proxy got {out.got} ({out.bad} corrupt)")
        cache[slot] = (out.connect_bytes, out.total_bytes)
    return cache[slot]


async def _summed_up(bench: ChaosBench, result: FaultResult, started: float, summary: str) -> FaultResult:
    """``result`` closed: none survived if the hub's own chunks suffered, its seconds, ``summary`` told."""
    if not await asyncio.to_thread(bench.durable_intact, result):
        result.survived = 0
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(summary)
    return result


def _count_fetch(result: FaultResult, out: ProbeFetch, wanted: int) -> None:
    """Add one probe fetch of ``wanted`` chunks to ``result``: a miss, its give-up time, wrong bytes."""
    if out.got < wanted:
        result.loads_missed += 1
        result.give_up(out.took)
    result.deadline_give_ups += out.outcome == "timeout"
    result.corrupt_delivered += out.bad


async def _damaged_wire(bench: ChaosBench, mode: str, rounds: int) -> FaultResult:
    result = FaultResult(f"wire_{mode}")
    started = time.monotonic()
    name = bench.server_names[0]
    sc = bench.pool[name]
    keys = bench.fresh_keys()
    await asyncio.to_thread(bench.put_on, name, keys)
    deadline = bench.s.fetch_deadline_seconds
    # A nixl answer is a few KB: one held-back read must outlast the deadline by itself.
    delay = deadline / 4 if bench.s.transport == "tcp" else 1.5 * deadline
    for r in range(rounds):
        lo, hi = await _answer_bytes(bench, sc, keys, f"{mode}-{r}")
        if mode == "flip":
            plan = FaultPlan("flip", after_bytes=bench.rng.randrange(lo, hi), flip_every=hi)
        elif mode == "truncate":
            plan = FaultPlan("truncate", after_bytes=bench.rng.randrange(lo, hi))
        else:
            plan = FaultPlan("delay", after_bytes=bench.rng.randrange(lo, lo + (hi - lo) // 2),
                             delay_seconds=delay)
        out = await _probe_fetch(bench, sc, keys, plan, f"{mode}-{r}")
        result.injected += 1
        result.in_flight += 1
        result.loads += 1
        _count_fetch(result, out, len(keys))
        result.integrity_rejected += out.refused
        if out.bad == 0 and sc.alive() and out.outcome != "hung":
            result.survived += 1
    return await _summed_up(bench, result, started, f"wire_{mode}: {result.injected} faults, "
                            f"{result.integrity_rejected} chunks refused by checksum, "
                            f"{result.corrupt_delivered} corrupt")


def sigkill_on_wire(bench: ChaosBench, rounds: int) -> FaultResult:
    """SIGKILL a server at an exact byte of a fetch from it (the proxy cuts the wire there too).

    On nixl the byte is one of the CHUNK_AT answers: the holder dies while the peer's lanes
    READ the chunks offered before it."""
    return bench.run(_sigkill_on_wire(bench, rounds))


async def _sigkill_on_wire(bench: ChaosBench, rounds: int) -> FaultResult:
    result = FaultResult("sigkill_at_byte")
    started = time.monotonic()
    restarting: dict[str, asyncio.Task[None]] = {}
    for r in range(rounds):
        name = bench.server_names[r % len(bench.server_names)]
        if name in restarting:
            await restarting.pop(name)
        sc = bench.pool[name]
        keys = bench.fresh_keys()
        await asyncio.to_thread(bench.put_on, name, keys)
        lo, hi = await _answer_bytes(bench, sc, keys, f"kill-{r}")
        one = (hi - lo) // len(keys)  # one chunk's share of the answer
        plan = FaultPlan("truncate", after_bytes=bench.rng.randrange(lo + one // 2, hi - one))

        def kill(_: FaultPlan, sc: SidecarProcess = sc) -> None:
            sc.send(signal.SIGKILL)

        out = await _probe_fetch(bench, sc, keys, plan, f"kill-{r}", on_fault=kill)
        result.injected += 1
        result.loads += 1
        result.in_flight += out.got < len(keys)
        _count_fetch(result, out, len(keys))
        if out.bad == 0 and out.outcome != "hung":
            result.survived += 1
        restarting[name] = asyncio.create_task(asyncio.to_thread(bench.restart, name))
        if (r + 1) % 5 == 0:
            bench.progress(f"sigkill_at_byte: {r + 1}/{rounds} kills, {result.corrupt_delivered} corrupt")
    for name, task in restarting.items():  # every killed server comes back and serves the hub
        await task
        try:
            await asyncio.to_thread(bench.wait_fetchable, name, RECOVERY_SECONDS)
        except TimeoutError as exc:
            result.survived = 0
            result.notes.append(str(exc))
    return await _summed_up(bench, result, started, f"sigkill_at_byte: {result.injected} kills at a random "
                            f"byte of a fetch, {result.corrupt_delivered} corrupt")


def reconnect_storm(bench: ChaosBench, rounds: int, probes: int = 16) -> FaultResult:
    """Kill every server at once and restart them together, while probes reconnect and drop."""
    return bench.run(_reconnect_storm(bench, rounds, probes))


async def _reconnect_storm(bench: ChaosBench, rounds: int, probes: int) -> FaultResult:
    from kv_offload_sidecar.data import connect

    result = FaultResult("reconnect_storm")
    started = time.monotonic()
    hub = bench.pool["hub"]
    host, port = _host_port(hub.status()["data_address"])
    async with FaultProxy(host, port) as proxy:
        for r in range(rounds):
            result.injected += 1
            clients = []
            for i in range(probes):  # many peers handshake and connect at once ...
                probe = await asyncio.to_thread(
                    probe_handshake, hub, bench.pool.pool_key, bench.probe_hello(f"storm-{r}-{i}"))
                clients.append(connect(bench.data_url(proxy.host, proxy.port), probe.session.session_id,
                                       probe.session.session_key, timeout=5.0))
            conns = await asyncio.gather(*clients, return_exceptions=True)
            for name in bench.server_names:  # ... every server dies at once ...
                bench.pool[name].kill()
            proxy.reset_all()  # ... and every probe connection drops
            for c in conns:
                if not isinstance(c, BaseException):
                    with contextlib.suppress(Exception):
                        await c.close()
            keys_by: dict[str, list[bytes]] = {}
            await asyncio.gather(*(asyncio.to_thread(bench.pool[n].start) for n in bench.server_names))
            t0 = time.monotonic()
            recovered = True
            for name in bench.server_names:
                try:
                    await asyncio.to_thread(bench.wait_fetchable, name, RECOVERY_SECONDS)
                except TimeoutError as exc:
                    recovered = False
                    result.notes.append(str(exc))
                keys_by[name] = bench.fresh_keys(8)
            recovery = time.monotonic() - t0
            result.series.setdefault("recovery_seconds", []).append((float(r), recovery))
            bad_before = result.corrupt_delivered
            for name, keys in keys_by.items():
                await asyncio.to_thread(bench.put_on, name, keys)
                if await asyncio.to_thread(bench.wait_visible, keys, RECOVERY_SECONDS):
                    await asyncio.to_thread(bench.timed_load, keys, result)
            await asyncio.to_thread(bench.check_durable, result)
            if recovered and result.corrupt_delivered == bad_before and result.lost == 0 \
                    and hub.alive():
                result.survived += 1
            bench.progress(f"reconnect_storm: round {r + 1}/{rounds} recovered in {recovery:.2f} s")
    result.seconds = round(time.monotonic() - started, 2)
    return result
