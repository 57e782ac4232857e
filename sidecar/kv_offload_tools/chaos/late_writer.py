"""Late writers on TCP and TLS: the two cases in which bytes could land in a row of vLLM's after
its load job's deadline, run by the fetching side against a holder in another process.

- ``holder_stopped_past_deadline``: the holder is stopped (SIGSTOP) mid-chunk (a chunk big
  enough to be received on the connection's thread), the fetcher's loop is blocked past the
  row's deadline, the row is filled with ``SENTINEL``, the holder resumed (SIGCONT); the rest
  of the chunk must be refused by the gate (``data.write_gates``), never written into the row.
  Then the slot the fetch had is reused: a later fetch of two chunks must verify.
- ``loop_blocked_past_deadline``: chunks small enough to be received on the event loop itself;
  once the first row fills, the loop is blocked past the rows' deadline while the holder keeps
  sending; the rows still offered then get ``SENTINEL`` and must keep it once the loop resumed.

The caller is the fetcher: these coroutines run on its event loop and block that loop on
purpose (as CPU throttling or a long pause would). Each returns what it saw, including the
bytes that changed after the deadline, counted twice (sentinel bytes overwritten, and the
gates' ``late_writes().bytes_after_deadline``; both must stay 0) and the writes the gates
refused. Used by ``tests/sidecar/data/test_late_writes.py`` (holders: test chunk servers) and
by the chaos bench's late-writer row (``chaos.faults.late_writer_row``: holders are sidecars).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kv_offload_sidecar.data import ReceiveStopped
from kv_offload_sidecar.data.write_gates import LateWriteCounts, late_writes
from kv_offload_sidecar.peers.row_landings import LandingState, LandingStore, RowLandings

# A row's bytes before anything landed in it.
GUARD = 0xEE
# A row's bytes once its deadline passed: whatever changes them was written late.
SENTINEL = 0x5A
# A chunk received on the connection's thread, long enough that a SIGSTOP lands mid-chunk.
BIG_CHUNK = 64 << 20
# Chunks received on the event loop (under ``stream_worker.OFF_LOOP_BYTES``), several reads each.
SMALL_CHUNK = 768 << 10
# Chunks the loop-blocked case fetches at once.
SMALL_CHUNKS = 24
# Bytes at a row's start watched for its first bytes.
WATCHED_BYTES = 4096
# Seconds any wait of these cases may take before it counts as hung: a bound against a hang of
# the caller, never the judge of a behaviour.
HANG_BOUND_SECONDS = 60.0

# Opens an authenticated data connection to the holder (``data.connect`` with its session).
Connect = Callable[[], Awaitable[Any]]
# The bytes a chunk must have, by key.
Expected = Callable[[bytes], bytes]


@dataclass
class HolderStoppedRun:
    """What ``holder_stopped_past_deadline`` saw."""

    # The SIGSTOP landed while the chunk was partly in its row, being received, and the rest
    # was still unsent at the deadline (else the case did not happen: the first bytes came
    # after the deadline, or the chunk was whole by then).
    stopped_mid_chunk: bool = False
    # Bytes that changed after the deadline: sentinel bytes overwritten plus the gates' count.
    bytes_after_deadline: int = 0
    # Writes the gates refused during the run (past the deadline or revoked).
    refused: int = 0
    # How the cut fetch ended: its exception, or the chunk count it returned.
    outcome: object = None
    # The cut chunk became visible in the store (must not).
    stored_cut_chunk: bool = False
    # Slots still in use once the cut fetch ended (must be 0: the slot went back).
    slots_in_use: int = 0
    # The two chunks fetched into the store after (reusing the slot), and those that verified.
    refetched: int = 0
    verified: int = 0


@dataclass
class LoopBlockedRun:
    """What ``loop_blocked_past_deadline`` saw."""

    # Rows still offered (not landed) when the loop was blocked past their deadline.
    late_rows: int = 0
    # Bytes of those rows that changed after the deadline, plus the gates' count.
    bytes_after_deadline: int = 0
    # Writes the gates refused during the run.
    refused: int = 0
    # How the fetch ended: its exception, or the chunk count it returned.
    outcome: object = None
    # Chunks that went to store slots instead, and those that verified.
    stored: int = 0
    verified: int = 0


def refusals(since: LateWriteCounts) -> int:
    """Writes refused by the gates since the snapshot ``since``."""
    now = late_writes()
    return (now.refused_past_deadline - since.refused_past_deadline
            + now.refused_revoked - since.refused_revoked)


def guarded_row(nbytes: int) -> memoryview:
    """A row of ``nbytes`` filled with ``GUARD``."""
    return memoryview(bytearray([GUARD]) * nbytes)


def changed_bytes(row: memoryview, fill: int) -> int:
    """Bytes of ``row`` that are no longer ``fill``."""
    return int(np.count_nonzero(np.frombuffer(row, dtype=np.uint8) != fill))


def _filling(row: memoryview) -> bool:
    return row[:WATCHED_BYTES] != bytes([GUARD]) * WATCHED_BYTES


def block_until(probe: Callable[[], object], bound: float = HANG_BOUND_SECONDS) -> bool:
    """Block the calling thread (the fetcher's loop) until ``probe()``; False past ``bound``."""
    end = time.monotonic() + bound
    while not probe():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def _block_past(deadline: float) -> None:
    """Block the calling thread (the fetcher's loop) until ``deadline`` (time.monotonic) passed."""
    while time.monotonic() <= deadline:
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.001)


class _StopWhenFilling:
    """SIGSTOP ``pid`` as soon as ``row``'s first bytes landed (a spinning thread), unless
    ``give_up`` came first."""

    def __init__(self, row: memoryview, pid: int) -> None:
        self.stopped = False
        self._row, self._pid = row, pid
        self._give_up = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="stop-holder", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not _filling(self._row):
            if self._give_up.is_set():
                return
        os.kill(self._pid, signal.SIGSTOP)
        self.stopped = True

    def done(self) -> bool:
        return not self._thread.is_alive()

    def give_up(self) -> None:
        self._give_up.set()
        self._thread.join()


async def _settle(task: asyncio.Task[Any]) -> object:
    """A fetch task's result or exception (bounded against a hang)."""
    (outcome,) = await asyncio.gather(asyncio.wait_for(task, HANG_BOUND_SECONDS), return_exceptions=True)
    return outcome


async def _close(client: Any) -> None:
    with contextlib.suppress(Exception):
        await client.close()


async def holder_stopped_past_deadline(connect: Connect, store: Any, keys: Sequence[bytes],
                                       expected: Expected, holder_pid: int,
                                       row_seconds: float) -> HolderStoppedRun:
    """The first case of the module docstring. ``keys``: two chunks of ``store.slot_bytes``
    bytes the holder (process ``holder_pid``) holds; ``store``: room for three at least, empty;
    ``row_seconds``: from the offer to the row's deadline (enough for the first bytes)."""
    out = HolderStoppedRun()
    nbytes = store.slot_bytes
    landings = RowLandings(on_landed=lambda: None)
    row = guarded_row(nbytes)
    before = late_writes()
    client = await connect()
    deadline = time.monotonic() + row_seconds
    offer = landings.offer(keys[0], row, deadline)
    assert offer is not None
    stopper = _StopWhenFilling(row, holder_pid)
    fetch = asyncio.create_task(client.fetch([keys[0]], LandingStore(store, landings), timeout=60))
    try:
        while not stopper.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        stopper.give_up()
        out.stopped_mid_chunk = (stopper.stopped and time.monotonic() < deadline
                                 and offer.state is LandingState.RECEIVING
                                 and row[-WATCHED_BYTES:] == bytes([GUARD]) * WATCHED_BYTES)
        if out.stopped_mid_chunk:
            # From here on the loop is blocked (as by CPU throttling or a pause) until the end.
            _block_past(deadline)
            # The holder may have sent the chunk's last byte before the SIGSTOP landed (the
            # socket buffers held the rest): then it landed whole before the deadline, and
            # no byte is left to refuse (nor to wait for below): the case did not happen.
            out.stopped_mid_chunk = row[-WATCHED_BYTES:] == bytes([GUARD]) * WATCHED_BYTES
        if out.stopped_mid_chunk:
            row[:] = bytes([SENTINEL]) * nbytes
            os.kill(holder_pid, signal.SIGCONT)
            # The connection's thread refuses the rest or writes it into the row (a bug).
            block_until(lambda: refusals(before) or row[-1] != SENTINEL)
    finally:
        os.kill(holder_pid, signal.SIGCONT)
    out.outcome = await _settle(fetch)
    await _close(client)
    if out.stopped_mid_chunk:
        out.bytes_after_deadline = changed_bytes(row, SENTINEL)
    out.bytes_after_deadline += late_writes().bytes_after_deadline - before.bytes_after_deadline
    out.refused = refusals(before)
    out.stored_cut_chunk = store.contains(keys[0])
    out.slots_in_use = store.used_bytes // store.slot_stride
    landings.release([offer])
    # The slot is reused: chunks committed there later verify, and no late byte lands in them.
    client = await connect()
    try:
        out.refetched = await client.fetch([keys[1], keys[0]], store, timeout=60)
    finally:
        await _close(client)
    out.verified = sum(verifies(store, k, expected) for k in keys[:2])
    return out


async def loop_blocked_past_deadline(connect: Connect, store: Any, keys: Sequence[bytes],
                                     expected: Expected, row_seconds: float) -> LoopBlockedRun:
    """The second case of the module docstring. ``keys``: chunks of ``store.slot_bytes`` (under
    ``OFF_LOOP_BYTES``) the holder holds; ``store``: room for all, empty."""
    out = LoopBlockedRun()
    nbytes = store.slot_bytes
    landings = RowLandings(on_landed=lambda: None)
    rows = [guarded_row(nbytes) for _ in keys]
    before = late_writes()
    client = await connect()
    deadline = time.monotonic() + row_seconds
    offers = [landings.offer(k, r, deadline) for k, r in zip(keys, rows)]
    fetch = asyncio.create_task(client.fetch(list(keys), LandingStore(store, landings), timeout=60))
    end = time.monotonic() + HANG_BOUND_SECONDS
    while not _filling(rows[0]) and not fetch.done() and time.monotonic() < end:
        await asyncio.sleep(0)
    # The loop is blocked past the deadline while the holder keeps sending.
    _block_past(deadline)
    late = [i for i, o in enumerate(offers) if o is not None and not o.landed]
    for i in late:
        rows[i][:] = bytes([SENTINEL]) * nbytes
    # A chunk cut off in its row ends the connection (ReceiveStopped); those whose rows were
    # past their deadline at their first byte went to their slots, the fetch's deadline being far.
    out.outcome = await _settle(fetch)
    out.late_rows = len(late)
    out.bytes_after_deadline = sum(changed_bytes(rows[i], SENTINEL) for i in late)
    out.bytes_after_deadline += late_writes().bytes_after_deadline - before.bytes_after_deadline
    out.refused = refusals(before)
    stored = [k for k in keys if store.contains(k)]
    out.stored = len(stored)
    out.verified = sum(verifies(store, k, expected) for k in stored)
    landings.release(offers)
    await _close(client)
    return out


def ended_as_expected(outcome: object) -> bool:
    """A cut fetch ends with the fetcher's own ``ReceiveStopped`` or returns its count."""
    return isinstance(outcome, (int, ReceiveStopped))


def verifies(store: Any, key: bytes, expected: Expected) -> bool:
    """Whether chunk ``key`` is visible in ``store`` with the bytes ``expected(key)``."""
    pin = store.pin(key)
    if pin is None:
        return False
    try:
        return pin.view == expected(key)
    finally:
        pin.release()


__all__ = [
    "BIG_CHUNK", "GUARD", "SENTINEL", "SMALL_CHUNK", "SMALL_CHUNKS", "HolderStoppedRun",
    "LoopBlockedRun", "block_until", "changed_bytes", "ended_as_expected", "guarded_row",
    "holder_stopped_past_deadline", "loop_blocked_past_deadline", "refusals", "verifies",
]
