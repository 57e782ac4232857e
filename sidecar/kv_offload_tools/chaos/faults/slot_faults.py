"""The nixl fault the byte-stream proxy cannot make: a holder's slot bytes change under a READ.

On the nixl transport the fetcher READs a chunk straight from the holder's store slot
(one-sided: CMA on one host, RDMA across hosts); the bytes never cross the TCP stream that
``FaultProxy`` damages. So ``slot_flip`` damages them where they are: it maps the holder's
store file (a shared-memory file; its path and geometry are in the sidecar's ``/v1/status``)
read-write, finds the slots of chunks staged for the hub by their contents (every chunk's
bytes are ``chunk_content(key)``), and, while the hub's engine loads those chunks, XORs one
byte of some of the slots with 0xFF -- bytes the holder pinned under a lease and promised
with their checksum in CHUNK_AT. The fetcher must find the damage (its lanes hash every
piece as it lands), count an integrity failure, store nothing of that chunk and hand
nothing wrong to the engine. Once the load ended the bytes are flipped back, so the holder
is whole again and every chunk of the round must load intact: none may be lost.

The first round and every fourth flip before the load is submitted (so the fetcher is sure
to read damaged bytes); the others at a random moment of the load, on chunks of the second
half of the batch (read last). A load counts as hung only if it never returns (or returns
more chunks than asked); how long it took to give up is a figure, not a verdict.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from kv_offload_tools.chaos.chunks import chunk_content, load_and_verify
from kv_offload_tools.chaos.faults.bench import (
    RECOVERY_SECONDS,
    ChaosBench,
    FaultResult,
)
from kv_offload_testing.sidecar_process import SidecarProcess

# Bytes of a slot compared to find which chunk it holds (then the whole slot is compared).
PREFIX_BYTES = 64
# Undisturbed loads timed before the first flip (the random flip moments scale with them).
CALIBRATION_LOADS = 3
# Every this many rounds (from the first) the flip lands before the load is submitted.
FLIP_FIRST_EVERY = 4
# Seconds a round waits for its load to return before calling it hung: only a bound against
# hanging the bench (the client gives up by itself at its deadline plus a grace).
LOADER_HANG_BOUND_SECONDS = 120.0
# Name of the hub's counter of chunks refused by their checksum.
INTEGRITY_METRIC = "kv_offload_integrity_failures_total"


class HolderSlots:
    """A sidecar's store file, mapped read-write by the bench (a context manager)."""

    def __init__(self, sc: SidecarProcess) -> None:
        store = sc.status()["store"]
        if store is None:
            raise RuntimeError(f"{sc.identity} has no store open")
        self.path = str(store["path"])
        self.num_slots = int(store["num_slots"])
        self.stride = int(store["slot_stride"])
        self.slot_bytes = int(store["slot_bytes"])
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(fd, self.num_slots * self.stride, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> HolderSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def slot(self, slot: int) -> bytes:
        start = slot * self.stride
        return self._mm[start:start + self.slot_bytes]

    def locate(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        """Key -> slot of the ``keys`` whose slot holds exactly ``chunk_content(key)``."""
        contents = {k: chunk_content(k, self.slot_bytes) for k in keys}
        by_prefix = {c[:PREFIX_BYTES]: k for k, c in contents.items()}
        found: dict[bytes, int] = {}
        for slot in range(self.num_slots):
            start = slot * self.stride
            key = by_prefix.get(self._mm[start:start + PREFIX_BYTES])
            if key is not None and self.slot(slot) == contents[key]:
                found[key] = slot
        return found

    def flip(self, slot: int, offset: int) -> None:
        """XOR the byte at ``offset`` of ``slot`` with 0xFF (a second flip restores it)."""
        if not 0 <= offset < self.slot_bytes:
            raise IndexError(f"offset {offset} outside a {self.slot_bytes}-byte slot")
        i = slot * self.stride + offset
        self._mm[i] ^= 0xFF


def slot_flip(bench: ChaosBench, rounds: int) -> FaultResult:
    """Flip bytes of the holder's slots while the hub's engine loads them (nixl); flip them back."""
    result = FaultResult("slot_flip")
    started = time.monotonic()
    hub = bench.pool["hub"]
    deadline = bench.s.fetch_deadline_seconds
    durations: list[float] = []
    struck = 0
    late = 0
    attempts = 0
    while result.injected < rounds and attempts < 3 * rounds + CALIBRATION_LOADS:
        name = bench.server_names[attempts % len(bench.server_names)]
        attempts += 1
        keys = bench.stage_on(name, result)
        if keys is None:
            continue
        if len(durations) < CALIBRATION_LOADS:  # how long an undisturbed load takes
            t0 = time.monotonic()
            bench.engines["hub"].load(keys, lambda i, view: None, deadline)
            durations.append(time.monotonic() - t0)
            continue
        sc = bench.pool[name]
        with HolderSlots(sc) as holder:
            where = holder.locate(keys)
            if len(where) < len(keys):
                result.notes.append(f"{name}: found {len(where)} of {len(keys)} staged chunks in its "
                                    "store file; round skipped")
                continue
            first = result.injected % FLIP_FIRST_EVERY == 0
            tail = range(len(keys) // 2, len(keys))
            victims = sorted(bench.rng.sample(tail, min(len(tail), max(1, len(keys) // 8))))
            spots = [(where[keys[i]], bench.rng.randrange(holder.slot_bytes)) for i in victims]
            delay = 0.0 if first else bench.rng.uniform(0.0, 0.7 * sorted(durations)[len(durations) // 2])
            refused_before = hub.metric(INTEGRITY_METRIC)
            late_before = bench.engines["hub"].timeouts
            bad_before, lost_before = result.corrupt_delivered, result.lost
            out: dict[str, Any] = {}

            def load(keys: list[bytes] = keys, out: dict[str, Any] = out) -> None:
                out["n"], out["took"] = bench.timed_load(keys, result)
                out["t1"] = time.monotonic()

            loader = threading.Thread(target=load, daemon=True)
            if first:  # damaged before the load is even submitted: its READs cannot miss it
                flipped_at = _flip(holder, spots)
                loader.start()
            else:
                loader.start()
                time.sleep(delay)  # a random moment of the load (or after it: then nothing to refuse)
                flipped_at = _flip(holder, spots)
            result.injected += 1
            try:
                # The client gives up by itself (its deadline plus a grace): waiting for it is
                # waiting for that state; the bound only keeps a hung load from hanging the bench.
                loader.join(LOADER_HANG_BOUND_SECONDS)
            finally:
                _flip(holder, spots)  # the holder is whole again
            restored = all(holder.slot(where[keys[i]]) == chunk_content(keys[i], holder.slot_bytes)
                           for i in victims)
        # Hung: never returned, or returned more chunks than asked. A give-up slower than the
        # deadline (a busy machine) is a figure (worst_give_up_seconds, late answers), not a hang.
        hung = loader.is_alive() or not out or not 0 <= out["n"] <= len(keys)
        late += bench.engines["hub"].timeouts - late_before
        if out and flipped_at < out["t1"]:
            result.in_flight += 1
        refused = int(hub.metric(INTEGRITY_METRIC) - refused_before)
        result.integrity_rejected += refused
        struck += refused > 0
        if not restored:
            result.notes.append(f"{name}: flipped bytes did not read back restored")
        recovered = _load_back(bench, keys, result)
        if (bench.durable_intact(result) and recovered and restored and not hung and sc.alive()
                and result.corrupt_delivered == bad_before and result.lost == lost_before):
            result.survived += 1
        if result.injected % 10 == 0:
            bench.progress(f"slot_flip: {result.injected} rounds, {result.integrity_rejected} chunks "
                           f"refused by checksum, {result.corrupt_delivered} corrupt")
    result.notes.append(f"{struck} of {result.injected} rounds' flipped bytes were READ by the hub and "
                        f"refused by checksum ({result.in_flight} flips landed while the load ran; "
                        f"undisturbed load of {bench.s.chunks_per_load} chunks: "
                        f"{1000 * sorted(durations)[len(durations) // 2]:.1f} ms)" if durations else
                        f"{struck} of {result.injected} rounds' flipped bytes refused by checksum")
    if late:
        result.notes.append(f"{late} loads answered past their deadline (the client gave up on them)")
    result.seconds = round(time.monotonic() - started, 2)
    bench.progress(f"slot_flip: {result.injected} rounds, {result.integrity_rejected} chunks refused "
                   f"by checksum, {result.corrupt_delivered} corrupt, {result.lost} lost")
    return result


def _flip(holder: HolderSlots, spots: Sequence[tuple[int, int]]) -> float:
    """Flip the byte at each (slot, offset) of ``spots``; returns when (monotonic)."""
    at = time.monotonic()
    for slot, offset in spots:
        holder.flip(slot, offset)
    return at


def _load_back(bench: ChaosBench, keys: list[bytes], result: FaultResult) -> bool:
    """Once the holder is whole: the hub loads every chunk of the round intact within
    ``RECOVERY_SECONDS`` (its link to the holder may be backing off after the failed fetch).
    Chunks it never gets back are lost; any wrong byte is a corrupt delivery."""
    end = time.monotonic() + RECOVERY_SECONDS
    best = 0
    while True:
        n, bad = 0, 0
        with contextlib.suppress(OSError, RuntimeError):
            n, bad = load_and_verify(bench.engines["hub"], keys, bench.s.chunk_bytes,
                                     bench.s.fetch_deadline_seconds)
        result.corrupt_delivered += bad
        best = max(best, n)
        if n == len(keys) or time.monotonic() > end:
            break
        time.sleep(0.2)
    if best < len(keys):
        result.lost += len(keys) - best
        result.notes.append(f"the hub loaded {best} of {len(keys)} chunks back from their restored "
                            f"holder within {RECOVERY_SECONDS:.0f} s")
        return False
    return True
