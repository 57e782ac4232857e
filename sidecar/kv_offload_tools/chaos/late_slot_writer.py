"""Late writers into store slots on UCX and NIXL: the cases in which bytes could land in a slot
of the fetcher's store after its fetch gave up, run by the fetching side against a holder in
another process. Unlike TCP and TLS (``chaos.late_writer``), the bytes do not pass through a
socket the fetcher reads: on UCX the holder writes them into the slot itself (put_zcopy), on
NIXL the fetcher's lane READs them one-sidedly. So a slot is handed back only once that write
is provably over (``data.ucx.client._DrainedReservation``, ``data.nixl.client._GuardedReservation``),
and a NIXL read job starts only while its chunk's write gate is open (``data.write_gates``).

- ``holder_stopped_mid_write`` (ucx; nixl over UCX's ``tcp`` transport, whose READs the holder
  serves): the holder is stopped (SIGSTOP) while the first chunk's bytes land in its slot, past
  the fetch's deadline; once the fetch has given up, the slot must still be held (the write may
  go on), it gets ``SENTINEL``, the holder is resumed (SIGCONT); the slot may be free again only
  once the write is over, so the sentinel it was given stays once it is free. Then every chunk
  is fetched again (the slot reused) and must verify.
- ``loop_blocked_before_read`` (nixl): the fetcher's loop is blocked past the fetch's deadline
  as it takes in the first CHUNK_AT, so the read job is posted after the deadline; the slot gets
  ``SENTINEL`` first: the gate must refuse the READ (counted), the slot keep the sentinel until
  it is free, and a fetch into the reused slot verify.

The caller is the fetcher, in a process of its own (UCX and NIXL read their environment once
per process: ``python -m kv_offload_tools.chaos.late_slot_writer`` runs the cases ``--runs``
times against ``--address`` and prints one JSON line of ``SlotRun`` dicts). Bytes after the
deadline are counted twice: sentinel bytes overwritten while the slot was free, plus the gates'
``late_writes().bytes_after_deadline``; both must stay 0. Used by
``tests/sidecar/data/test_late_writes.py`` (holders: test chunk servers) and by the chaos bench's
late-writer row (``chaos.faults.late_writer_row``: holders are sidecars).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kv_offload_sidecar.data.write_gates import late_writes

from kv_offload_tools.chaos.late_writer import (
    HANG_BOUND_SECONDS,
    SENTINEL,
    WATCHED_BYTES,
    block_until,
    verifies,
    changed_bytes,
    refusals,
)

# Seconds a fetch of these cases may take: the holder is stopped well before it ends.
FETCH_SECONDS = 1.0

# Opens an authenticated data connection to the holder (``data.connect`` with its session).
Connect = Callable[[], Awaitable[Any]]
# The bytes a chunk must have, by key.
Expected = Callable[[bytes], bytes]


@dataclass
class SlotRun:
    """What one case saw."""

    # "holder_stopped" or "loop_blocked".
    case: str = ""
    # The fault struck a write in flight: the holder stopped with the chunk partly in its slot,
    # or the read job posted after the deadline (else the case did not happen).
    in_flight: bool = False
    # Slots still held once the fetch had given up, while the write could go on (must be 1 in
    # the holder_stopped case; the loop_blocked case's READ never started, so 0 or 1).
    held_by_failure: int = 0
    # Bytes that changed after the deadline: sentinel bytes overwritten once the slot was
    # free, plus the gates' count (must be 0).
    bytes_after_deadline: int = 0
    # Writes the gates refused during the run.
    refused: int = 0
    # How the cut fetch ended: its exception's text, or None when it returned.
    error: str | None = None
    # Slots in use once the write was over and before the refetch (must be 0).
    held_at_end: int = 0
    # Chunks fetched into the store afterwards (reusing the slot), and those that verified.
    refetched: int = 0
    verified: int = 0
    # Why the fetch after the cut failed (the holder gone, say), or None.
    refetch_error: str | None = None


class _Watched:
    """``store`` with its first reservation remembered (the slot the cut chunk gets) and zeroed."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.slot_bytes = store.slot_bytes
        self.first: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def begin_write(self, key: bytes) -> Any:
        res = self._store.begin_write(key)
        if res is not None and not self.first:
            import numpy as np

            np.frombuffer(res.view, dtype=np.uint8)[:] = 0  # what a slot reused by runs before held
            self.first.append(res)
        return res


def _reserved(store: Any) -> int:
    """Slots of ``store`` held by a write (in use, not holding a visible chunk)."""
    return store.used_bytes // store.slot_stride - len(store)


def _slot(store: Any, slot: int) -> memoryview:
    """Slot ``slot``'s bytes, reserved or not."""
    start = slot * store.slot_stride
    return store._mv[start:start + store.slot_bytes]


async def _wait(what: str, probe: Callable[[], object]) -> bool:
    """Until ``probe()`` (False past ``HANG_BOUND_SECONDS``: a bound against a hang, not a judge)."""
    end = time.monotonic() + HANG_BOUND_SECONDS
    while not probe():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.005)
    return True


async def _refetch(connect: Connect, store: Any, keys: Sequence[bytes], expected: Expected,
                   out: SlotRun) -> None:
    """Fetch every key again (the freed slot is reused) and verify what is stored."""
    try:
        client = await connect()
    except Exception as exc:  # the holder died (counted, not raised: a bench run goes on)
        out.refetch_error = f"{type(exc).__name__}: {exc}"
        return
    try:
        out.refetched = await client.fetch(list(keys), store, timeout=30)
    except Exception as exc:
        out.refetch_error = f"{type(exc).__name__}: {exc}"
    finally:
        await client.close()
    out.verified = sum(verifies(store, k, expected) for k in keys)


async def holder_stopped_mid_write(connect: Connect, store: Any, keys: Sequence[bytes],
                                   expected: Expected, holder_pid: int) -> SlotRun:
    """The first case of the module docstring. ``keys``: chunks of ``store.slot_bytes`` (big
    enough that a SIGSTOP lands mid-chunk) the holder (process ``holder_pid``) holds;
    ``store``: empty, with room for all of them and one more."""
    out = SlotRun("holder_stopped")
    watched = _Watched(store)
    stopped = threading.Event()
    give_up = threading.Event()

    def stop_when_filling() -> None:
        while not watched.first:
            if give_up.is_set():
                return
        view, blank = watched.first[0].view, bytes(WATCHED_BYTES)
        while view[:WATCHED_BYTES] == blank:
            if give_up.is_set():
                return
        os.kill(holder_pid, signal.SIGSTOP)
        stopped.set()

    before = late_writes()
    stopper = threading.Thread(target=stop_when_filling, name="stop-holder", daemon=True)
    stopper.start()
    client = await connect()
    fetch = asyncio.ensure_future(client.fetch(keys[:1], watched, timeout=FETCH_SECONDS))
    raw: memoryview | None = None
    try:
        # The fetch gives up (its connection fails) at its deadline, the holder stopped.
        await _wait("the fetch gave up", lambda: client.closed or fetch.done())
        give_up.set()
        stopper.join()
        # The holder may have written the chunk's last byte before the SIGSTOP landed: then
        # the fetch returned it, visible in the slot, and the case did not happen.
        landed = fetch.done() and not fetch.cancelled() and fetch.exception() is None
        if stopped.is_set() and watched.first and not landed:
            raw = _slot(store, watched.first[0].slot)
            out.in_flight = raw[-WATCHED_BYTES:] == bytes(WATCHED_BYTES)  # partly written
            out.held_by_failure = _reserved(store)
            raw[:] = bytes([SENTINEL]) * len(raw)
    finally:
        os.kill(holder_pid, signal.SIGCONT)
    # The slot is free only once the write is over: from then on nothing may change it. A slot
    # held at the failure may take the rest of the write meanwhile (nobody reads it): it gets
    # the sentinel again the moment it is seen free.
    await _wait("the slot freed", lambda: _reserved(store) == 0)
    if raw is not None and out.held_by_failure:
        raw[:] = bytes([SENTINEL]) * len(raw)
    try:
        await asyncio.wait_for(fetch, HANG_BOUND_SECONDS)  # NIXL: returns once no READ runs
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.held_at_end = _reserved(store)
    if raw is not None:
        out.bytes_after_deadline = changed_bytes(raw, SENTINEL)
        raw.release()
    await client.close()
    out.bytes_after_deadline += late_writes().bytes_after_deadline - before.bytes_after_deadline
    out.refused = refusals(before)
    await _refetch(connect, store, keys, expected, out)
    return out


async def loop_blocked_before_read(connect: Connect, store: Any, keys: Sequence[bytes],
                                   expected: Expected) -> SlotRun:
    """The second case of the module docstring (a NIXL client: ``_on_frame`` takes CHUNK_AT in).
    ``keys``: chunks the holder holds; ``store``: empty, with room for all of them."""
    out = SlotRun("loop_blocked")
    watched = _Watched(store)
    before = late_writes()
    client = await connect()
    take_in = client._on_frame
    raw: list[memoryview] = []

    def late_on_frame(header: Any, payload: bytearray) -> bool:
        p = client._chunks.get(header.request_id)
        if raw or p is None or not watched.first:
            return take_in(header, payload)
        # The loop is blocked (as by CPU throttling) past the fetch's deadline as the first
        # CHUNK_AT comes in: its read job is posted late, into a slot given the sentinel.
        while time.monotonic() <= p.gate.deadline:
            time.sleep(max(0.0, p.gate.deadline - time.monotonic()) + 0.001)
        raw.append(_slot(store, watched.first[0].slot))
        raw[0][:] = bytes([SENTINEL]) * len(raw[0])
        out.in_flight = True
        taken = take_in(header, payload)
        # Still blocked until the lane handed the job back: its READ ran or was refused
        # before the loop's own deadline handling could end the fetch first.
        block_until(lambda: client._finished or not client._reading)
        return taken

    client._on_frame = late_on_frame
    try:
        await client.fetch(keys[:1], watched, timeout=FETCH_SECONDS)
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    # The fetch returns once no READ of the connection is queued or running.
    out.held_by_failure = _reserved(store)
    await _wait("the slot freed", lambda: _reserved(store) == 0)
    out.held_at_end = _reserved(store)
    if raw:
        out.bytes_after_deadline = changed_bytes(raw[0], SENTINEL)
        raw[0].release()
    await client.close()
    out.bytes_after_deadline += late_writes().bytes_after_deadline - before.bytes_after_deadline
    out.refused = refusals(before)
    await _refetch(connect, store, keys, expected, out)
    return out


# The cases each plane runs by default. NIXL's holder_stopped needs UCX's tcp transport (over
# cma the fetcher's READ copies from a stopped holder all the same), where the holder crashes
# today (SIGSEGV: it darkens a view its UCX still sends from, see test_late_writes).
PLANE_CASES = {"ucx": ("holder_stopped",), "nixl": ("loop_blocked",)}
CASES = ("holder_stopped", "loop_blocked")


async def run_cases(plane: str, connect: Connect, store: Any, keys: Sequence[bytes],
                    expected: Expected, holder_pid: int, runs: int,
                    cases: Sequence[str] | None = None) -> list[SlotRun]:
    """``runs`` runs of each of ``cases`` (default: the plane's) into ``store``, emptied first."""
    out: list[SlotRun] = []
    for _ in range(runs):
        for case in cases or PLANE_CASES[plane]:
            store.drop_when_released(store.keys())
            if case == "holder_stopped":
                out.append(await holder_stopped_mid_write(connect, store, keys, expected, holder_pid))
            else:
                out.append(await loop_blocked_before_read(connect, store, keys, expected))
    return out


def configure(plane: str, ucx_tls: str) -> None:
    """Set this process's UCX environment for ``plane`` (before UCX or NIXL is imported)."""
    if plane == "ucx":
        from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env

        configure_ucx_env(ucx_tls, net_devices="lo" if "tcp" in ucx_tls else None)
    else:
        from kv_offload_sidecar.data.nixl.runtime import configure_nixl_env

        configure_nixl_env(ucx_tls or None)  # empty: UCX's own choice


def run_fetcher(plane: str, *, ucx_tls: str, address: str, holder_pid: int,
                session: tuple[bytes, bytes], contents: dict[bytes, bytes], shm_dir: str, runs: int = 1,
                cases: str = "", env: dict[str, str] | None = None,
                timeout: float = 120) -> list[dict[str, Any]]:
    """Run ``main`` in a fetcher process of its own (environment ``env``) against the holder at
    ``address`` (process ``holder_pid``, the session ``(id, key)``), which holds ``contents``
    (key -> bytes, all one size); its ``SlotRun`` dicts. RuntimeError when it failed."""
    import subprocess
    import sys
    import tempfile

    keys = list(contents)
    with tempfile.NamedTemporaryFile(dir=shm_dir, prefix="late-slot-contents-") as f:
        for key in keys:
            f.write(contents[key])
        f.flush()
        done = subprocess.run(
            [sys.executable, "-m", "kv_offload_tools.chaos.late_slot_writer", "--plane", plane,
             "--ucx-tls", ucx_tls, "--address", address, "--holder-pid", str(holder_pid),
             "--session-id", session[0].hex(), "--session-key", session[1].hex(),
             "--keys", ",".join(k.hex() for k in keys), "--contents", f.name,
             "--chunk-bytes", str(len(contents[keys[0]])), "--shm-dir", shm_dir, "--runs", str(runs),
             "--cases", cases],
            capture_output=True, text=True, timeout=timeout, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {plane} late-writer fetcher exited with {done.returncode}: "
                           f"{done.stderr[-3000:]}")
    return list(json.loads(lines[-1])["runs"])


def main(argv: Sequence[str] | None = None) -> None:
    """The fetcher process: ``--plane ucx|nixl --ucx-tls T --address A --holder-pid P
    --session-id HEX --session-key HEX --keys HEX,... --chunk-bytes B --content tools|tests
    --shm-dir D --runs N [--cases c,...]``; prints ``{"runs": [SlotRun dicts]}``."""
    p = argparse.ArgumentParser(prog="kv_offload_tools.chaos.late_slot_writer")
    p.add_argument("--plane", choices=sorted(PLANE_CASES), required=True)
    p.add_argument("--ucx-tls", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--holder-pid", type=int, required=True)
    p.add_argument("--session-id", required=True)
    p.add_argument("--session-key", required=True)
    p.add_argument("--keys", required=True)
    p.add_argument("--contents", required=True,
                   help="a file of the keys' expected bytes, one chunk after the other")
    p.add_argument("--chunk-bytes", type=int, required=True)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--cases", default="")
    args = p.parse_args(argv)
    configure(args.plane, args.ucx_tls)

    from kv_offload_sidecar.data import connect
    from kv_offload_sidecar.engine.store_view import slot_stride_for
    from kv_offload_sidecar.store.chunk_store import ChunkStore

    keys = [bytes.fromhex(k) for k in args.keys.split(",")]
    with open(args.contents, "rb") as f:
        blob = f.read()
    contents = {k: blob[i * args.chunk_bytes:(i + 1) * args.chunk_bytes] for i, k in enumerate(keys)}
    session_id, session_key = bytes.fromhex(args.session_id), bytes.fromhex(args.session_key)

    def connect_holder() -> Awaitable[Any]:
        return connect(args.address, session_id, session_key, timeout=20)

    store = ChunkStore(args.chunk_bytes, (len(keys) + 1) * slot_stride_for(args.chunk_bytes),
                       directory=args.shm_dir, name=f"late-slot-{os.getpid()}")
    try:
        runs = asyncio.run(run_cases(args.plane, connect_holder, store, keys, contents.__getitem__,
                                     args.holder_pid, args.runs,
                                     [c for c in args.cases.split(",") if c] or None))
    finally:
        store.close()
    print(json.dumps({"runs": [asdict(r) for r in runs]}), flush=True)


if __name__ == "__main__":
    main()
