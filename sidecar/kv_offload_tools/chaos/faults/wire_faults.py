"""Fault scenarios on the wire: a hand-driven peer fetches through ``FaultProxy``.

The peer is the receiving half of a sidecar: a real handshake with the pool
key, the runtime's own data-plane client and a real ``ChunkStore``. A sidecar
advertises only its own data address, so a proxy cannot be slipped between
two sidecar processes; it sits between this peer and a server's data port,
where it flips, truncates or delays bytes, or marks the byte at which the
server is killed. Each scenario returns a ``FaultResult``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable

from kv_offload_sidecar.store.chunk_store import ChunkStore

from kv_offload_tools.chaos.chunks import chunk_content
from kv_offload_tools.chaos.fault_proxy import FaultPlan, FaultProxy
from kv_offload_tools.chaos.faults.bench import (
    GIVE_UP_SLACK_SECONDS,
    RECOVERY_SECONDS,
    ChaosBench,
    FaultResult,
)
from kv_offload_tools.chaos.probes import probe_handshake
from kv_offload_tools.sidecar_process import SidecarProcess


def damaged_wire(bench: ChaosBench, mode: str, rounds: int) -> FaultResult:
    """Flip, truncate or delay the bytes of fetches from a server through ``FaultProxy``."""
    return asyncio.run(_damaged_wire(bench, mode, rounds))


async def _probe_fetch(bench: ChaosBench, sc: SidecarProcess, keys: list[bytes], plan: FaultPlan, tag: str,
                       on_fault: Callable[[FaultPlan], None] | None = None
                       ) -> tuple[int, float, int, int]:
    """One fetch by a hand-driven peer through the proxy into its own store.

    Returns (leading chunks fetched or -1 on error, seconds, visible chunks with
    wrong bytes, chunks refused by checksum).
    """
    from kv_offload_sidecar.data import TransportError, connect

    deadline = bench.s.fetch_deadline_seconds
    probe = await asyncio.to_thread(probe_handshake, sc, bench.pool.pool_key,
                                    bench.pool.local_hello(identity=f"probe-{tag}"))
    host, _, port = probe.server_hello.data_address.removeprefix("tcp://").rpartition(":")
    store = ChunkStore(bench.s.chunk_bytes, (len(keys) + 1) * bench.s.chunk_bytes,
                       directory=bench.pool.workdir, name=f"probe-{tag}")
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
                    bad += pin.view != chunk_content(key, bench.s.chunk_bytes)
        return got, took, bad, int(store.stats().get("integrity_failures", 0))
    finally:
        store.close()


async def _damaged_wire(bench: ChaosBench, mode: str, rounds: int) -> FaultResult:
    result = FaultResult(f"wire_{mode}")
    started = time.monotonic()
    name = bench.server_names[0]
    sc = bench.pool[name]
    keys = bench.fresh_keys()
    await asyncio.to_thread(bench.put_on, name, keys)
    total = len(keys) * bench.s.chunk_bytes
    deadline = bench.s.fetch_deadline_seconds
    for r in range(rounds):
        if mode == "flip":
            plan = FaultPlan("flip", after_bytes=bench.rng.randrange(0, total), flip_every=total)
        elif mode == "truncate":
            plan = FaultPlan("truncate", after_bytes=bench.rng.randrange(0, total))
        else:
            plan = FaultPlan("delay", after_bytes=bench.rng.randrange(0, total // 2),
                             delay_seconds=deadline / 4)
        got, took, bad, refused = await _probe_fetch(bench, sc, keys, plan, f"{mode}-{r}")
        result.injected += 1
        result.in_flight += 1
        result.loads += 1
        if got < len(keys):
            result.loads_missed += 1
            result.give_up(took)
        result.corrupt_delivered += bad
        result.integrity_rejected += refused
        if bad == 0 and sc.alive() and took <= deadline + GIVE_UP_SLACK_SECONDS:
            result.survived += 1
    if not await asyncio.to_thread(bench.durable_intact, result):
        result.survived = 0
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"wire_{mode}: {result.injected} faults, {result.integrity_rejected} chunks "
                   f"refused by checksum, {result.corrupt_delivered} corrupt")
    return result


def sigkill_on_wire(bench: ChaosBench, rounds: int) -> FaultResult:
    """SIGKILL a server at an exact byte of a fetch from it (the proxy cuts the wire there too)."""
    return asyncio.run(_sigkill_on_wire(bench, rounds))


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
        total = len(keys) * bench.s.chunk_bytes
        plan = FaultPlan("truncate", after_bytes=bench.rng.randrange(bench.s.chunk_bytes // 2,
                                                                     total - bench.s.chunk_bytes))

        def kill(_: FaultPlan, sc: SidecarProcess = sc) -> None:
            sc.send(signal.SIGKILL)

        got, took, bad, _ = await _probe_fetch(bench, sc, keys, plan, f"kill-{r}", on_fault=kill)
        result.injected += 1
        result.loads += 1
        result.corrupt_delivered += bad
        if got < len(keys):
            result.in_flight += 1
            result.loads_missed += 1
            result.give_up(took)
        if bad == 0 and took <= bench.s.fetch_deadline_seconds + GIVE_UP_SLACK_SECONDS:
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
    if not await asyncio.to_thread(bench.durable_intact, result):
        result.survived = 0
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"sigkill_at_byte: {result.injected} kills at a random byte of a fetch, "
                   f"{result.corrupt_delivered} corrupt")
    return result


def reconnect_storm(bench: ChaosBench, rounds: int, probes: int = 16) -> FaultResult:
    """Kill every server at once and restart them together, while probes reconnect and drop."""
    return asyncio.run(_reconnect_storm(bench, rounds, probes))


async def _reconnect_storm(bench: ChaosBench, rounds: int, probes: int) -> FaultResult:
    from kv_offload_sidecar.data import connect

    result = FaultResult("reconnect_storm")
    started = time.monotonic()
    hub = bench.pool["hub"]
    data = hub.status()["data_address"].removeprefix("tcp://")
    host, _, port = data.rpartition(":")
    async with FaultProxy(host, int(port)) as proxy:
        for r in range(rounds):
            result.injected += 1
            clients = []
            for i in range(probes):  # many peers handshake and connect at once ...
                probe = await asyncio.to_thread(
                    probe_handshake, hub, bench.pool.pool_key,
                    bench.pool.local_hello(identity=f"storm-{r}-{i}"))
                clients.append(connect(proxy.address, probe.session.session_id,
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
                if await asyncio.to_thread(bench.wait_visible, keys, 5.0):
                    await asyncio.to_thread(bench.timed_load, keys, result)
            await asyncio.to_thread(bench.check_durable, result)
            if recovered and result.corrupt_delivered == bad_before and result.lost == 0 \
                    and hub.alive():
                result.survived += 1
            bench.progress(f"reconnect_storm: round {r + 1}/{rounds} recovered in {recovery:.2f} s")
    result.seconds = round(time.monotonic() - started, 2)
    return result
