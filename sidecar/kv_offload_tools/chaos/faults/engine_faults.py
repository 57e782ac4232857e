"""Fault scenarios the engines live through: signals to the sidecars and a write flood.

Each takes a started ``ChaosBench`` and returns a ``FaultResult``; the hub's
engine loads and verifies every chunk, so a fault that delivered a wrong byte
or lost a chunk shows in the result.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

from kv_offload_tools.chaos.chunks import load_and_verify, store_chunks
from kv_offload_tools.chaos.faults.bench import (
    HUNG_AFTER_SECONDS,
    RECOVERY_SECONDS,
    ChaosBench,
    FaultResult,
)


def sigkill_mid_fetch(bench: ChaosBench, kills: int, seconds: float) -> FaultResult:
    """SIGKILL the serving peer while the hub's engine loads from it; restart; repeat."""
    result = FaultResult("sigkill_mid_fetch")
    started = time.monotonic()
    landed = 0
    durations: list[float] = []
    restarting: dict[str, threading.Thread] = {}
    idx = 0
    while landed < kills and time.monotonic() - started < seconds:
        name = bench.server_names[idx % len(bench.server_names)]
        idx += 1
        t = restarting.pop(name, None)
        if t is not None:
            t.join()
            with contextlib.suppress(TimeoutError):
                bench.wait_fetchable(name, RECOVERY_SECONDS)
        keys = bench.stage_on(name, result)
        if keys is None:
            continue
        if len(durations) < 3:  # calibrate: how long an undisturbed fetch takes (no verification)
            t0 = time.monotonic()
            bench.engines["hub"].load(keys, lambda i, view: None, bench.s.fetch_deadline_seconds)
            durations.append(time.monotonic() - t0)
            continue
        delay = bench.rng.uniform(0.0, 0.7 * sorted(durations)[len(durations) // 2])
        out: dict[str, Any] = {}

        def load(keys: list[bytes] = keys, out: dict[str, Any] = out) -> None:
            out["t0"] = time.monotonic()
            out["n"], out["took"] = bench.timed_load(keys, result)
            out["t1"] = time.monotonic()

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(delay)
        killed_at = time.monotonic()
        bench.pool[name].kill()
        result.injected += 1
        loader.join(bench.s.fetch_deadline_seconds + HUNG_AFTER_SECONDS)
        hung = loader.is_alive() or not out  # the load never returned (or raised)
        mid = not hung and out["t0"] <= killed_at <= out["t1"] and out["n"] < len(keys)
        landed += mid
        if bench.durable_intact(result) and not hung:
            result.survived += 1
        restarting[name] = threading.Thread(target=bench.restart, args=(name,))
        restarting[name].start()
        if result.injected % 10 == 0:
            bench.progress(f"sigkill_mid_fetch: {result.injected} kills, {landed} mid-fetch, "
                           f"{result.loads_missed} loads missed, {result.corrupt_delivered} corrupt")
    for name, t in restarting.items():
        t.join()
        try:
            bench.wait_fetchable(name, RECOVERY_SECONDS)
        except TimeoutError as exc:
            result.survived -= 1
            result.notes.append(f"{name} did not recover: {exc}")
    result.in_flight = landed
    result.notes.append(f"{landed} of {result.injected} kills landed while a load was in flight "
                        f"and cut it short (undisturbed fetch of {bench.s.chunks_per_load} chunks: "
                        f"{1000 * sorted(durations)[len(durations) // 2]:.1f} ms)")
    result.series["mid_fetch_kills"] = [(0.0, float(landed))]
    result.seconds = round(time.monotonic() - started, 2)
    return result


def sigstop_past_deadline(bench: ChaosBench, rounds: int) -> FaultResult:
    """SIGSTOP the serving peer; the hub's sidecar must give up on it and answer the engine's
    load with a miss itself (the engine's client counts no late or failed answer); SIGCONT;
    recover. How long the load took to give up is reported (``worst_give_up_seconds``), not judged."""
    result = FaultResult("sigstop_past_deadline")
    started = time.monotonic()
    hub = bench.engines["hub"]
    for r, name, keys in bench.staged_rounds(rounds, result):
        sc = bench.pool[name]
        sc.freeze()  # every thread stopped: none answers the load below
        result.injected += 1
        result.in_flight += 1
        late, failed = hub.timeouts, hub.errors
        try:
            n, took = bench.timed_load(keys, result)
            result.series.setdefault("give_up_seconds", []).append((float(r), took))
            time.sleep(bench.s.fetch_deadline_seconds)  # the fault: stopped well past the deadline
        finally:
            sc.send(signal.SIGCONT)
        gave_up = n < len(keys) and (hub.timeouts, hub.errors) == (late, failed)
        result.deadline_give_ups += gave_up
        intact = bench.durable_intact(result)
        try:
            recovery = bench.wait_fetchable(name, RECOVERY_SECONDS)
            result.series.setdefault("recovery_seconds", []).append((float(r), recovery))
            if intact and gave_up:
                result.survived += 1
        except TimeoutError as exc:
            result.notes.append(str(exc))
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"sigstop_past_deadline: {result.injected} stops, worst give-up "
                   f"{result.worst_give_up_seconds:.3f} s")
    return result


def leave_and_rejoin(bench: ChaosBench, rounds: int) -> FaultResult:
    """A server leaves (SIGTERM) while the hub loads its chunks, then rejoins under its name."""
    result = FaultResult("leave_and_rejoin")
    started = time.monotonic()
    for r, name, keys in bench.staged_rounds(rounds, result):
        sc = bench.pool[name]
        result.injected += 1
        code = sc.terminate(30)
        if code != 0:
            result.notes.append(f"{name} exited {code} on SIGTERM")
        bench.timed_load(keys, result)  # gone: a miss, promptly
        sc.start()
        try:
            recovery = bench.wait_fetchable(name, RECOVERY_SECONDS)
            result.series.setdefault("recovery_seconds", []).append((float(r), recovery))
            if bench.durable_intact(result) and code == 0:
                result.survived += 1
        except TimeoutError as exc:
            result.notes.append(str(exc))
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"leave_and_rejoin: {result.injected} rounds, {result.survived} rejoined")
    return result


def restart_under_engine(bench: ChaosBench, rounds: int) -> FaultResult:
    """A server's sidecar restarts while its engine keeps its client (vLLM keeps running).

    The engine goes on storing through the client it had; whatever it stores
    after the restart must reach the new sidecar's store intact (or be refused),
    and the hub must never load a wrong byte of it.
    """
    result = FaultResult("restart_under_engine")
    started = time.monotonic()
    for r in range(rounds):
        name = bench.server_names[r % len(bench.server_names)]
        engine = bench.engine(name)  # kept across the restart
        bench.restart(name)
        result.injected += 1
        keys = bench.fresh_keys(8)
        written = 0
        for _ in range(3):  # the first call may find the old connection dead
            written = store_chunks(engine, keys, bench.s.chunk_bytes)
            if written:
                break
        bad_before = result.corrupt_delivered
        if written and bench.wait_visible(keys, RECOVERY_SECONDS):
            bench.timed_load(keys, result)  # the hub fetches them from the restarted sidecar
        got, bad = load_and_verify(engine, keys, bench.s.chunk_bytes, 5.0)
        result.loads += 1
        result.corrupt_delivered += bad
        bench.retire_engine(name, engine)
        with contextlib.suppress(TimeoutError):
            bench.wait_fetchable(name, RECOVERY_SECONDS)
        bench.check_durable(result)
        if result.corrupt_delivered == bad_before and result.lost == 0:
            result.survived += 1
    if result.corrupt_delivered:
        result.notes.append("chunks stored through the engine's client after its sidecar restarted "
                            "were delivered with wrong bytes")
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"restart_under_engine: {result.injected} restarts, "
                   f"{result.corrupt_delivered} corrupt chunks delivered")
    return result


def write_flood(bench: ChaosBench, factor: int = 10) -> FaultResult:
    """Write ``factor`` x the flood sidecar's budget while loading recent chunks back."""
    result = FaultResult("write_flood_10x" if factor == 10 else f"write_flood_{factor}x")
    started = time.monotonic()
    sc = bench.pool["flood"]
    budget = bench.s.flood_capacity_bytes
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
    engine = bench.engine("flood")
    batch = max(1, min(bench.s.chunks_per_load, budget // bench.s.chunk_bytes // 4))
    target = factor * budget
    written = 0
    try:
        while written < target:
            keys = bench.fresh_keys(batch)
            n = store_chunks(engine, keys, bench.s.chunk_bytes)
            written += n * bench.s.chunk_bytes
            result.injected += 1
            got, bad = load_and_verify(engine, keys, bench.s.chunk_bytes, 5.0)
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
    evictions = int(sc.metric("kv_offload_evictions_total"))
    result.notes.append(f"wrote {written / 2**20:.0f} MiB into a {budget / 2**20:.0f} MiB store "
                        f"({evictions} evictions, {len(samples)} samples of used bytes; "
                        f"shared-memory file {file_bytes} bytes)")
    if file_bytes > budget:
        result.notes.append(f"store file of {file_bytes} bytes exceeds the budget")
        result.store_peak_bytes = max(result.store_peak_bytes, file_bytes)
    result.series["store_used_bytes"] = samples
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"write_flood: {written / 2**20:.0f} MiB written, peak "
                   f"{peak / 2**20:.2f} MiB of {budget / 2**20:.0f} MiB")
    return result
