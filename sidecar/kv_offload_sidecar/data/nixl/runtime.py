"""The process's NIXL agents: one per lane thread, each lane the only caller of its agent.

A one-sided READ over CMA is a kernel copy made inside NIXL's post call, which releases
the GIL; so every agent lives in its own thread (a *lane*) and the asyncio loop only hands
work to lanes and takes their results (``call_soon_threadsafe``). A sidecar runs one lane
per core it may use (``configure_nixl_env``), so its cores copy side by side. A lane reads a chunk as one transfer of
its ``PIECE_BYTES`` pieces and then hashes the
slot in one GIL-free call (xxh3): two GIL hand-offs per chunk, whatever its size. Lane 0's
agent also serves: it registers each peer connection's view of the store (``exports``). An idle lane sleeps in its
queue. A new
endpoint's wire-up needs both agents to progress, so for ``WIREUP_SECONDS`` after a view was
exported (holder) or a holder's metadata loaded (fetcher) every lane calls NIXL's progress
(``get_new_notifs``) every ``HOT_PUMP_SECONDS``; otherwise only lane 0 does, every
``IDLE_PUMP_SECONDS``: no busy progress thread. A fetcher's lane wires its endpoint up at
its first READ, which may come long after the connection's window: so a holder's lane 0
also pumps hot for ``WIREUP_SECONDS`` after each FETCH it answers (``serving_window``).
Without that, the first READ on a connection waited for the holder's once-a-second
progress: 0.65-0.80 s for 128 MiB, against 0.04 s once wired up.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.data.base import check_loop
from kv_offload_sidecar.extras import NIXL_PACKAGE, require

log = logging.getLogger(__name__)

# What the nixl transport imports; the wheel it comes from is extras.NIXL_PACKAGE (installed
# with --no-deps: its declared torch and numpy requirements serve GPU paths only).
NIXL_MODULE = "nixl_cu12"
# Lane threads (agents) of a process that did not configure them (tests, benches); a
# sidecar runs its ``--lanes`` offer (``data.lanes.lanes_offered``: one per core of its ``cpu_budget``,
# at most 8), so a fetcher's reads and checksums spread over the cores it is given.
DEFAULT_LANES = 2
# Bytes of one descriptor of a chunk's READ (a chunk is read as one transfer of its pieces).
PIECE_BYTES = 512 << 10
# Seconds lane 0 progresses its agent often after exporting a view (endpoint wire-up).
WIREUP_SECONDS = 5.0
# Seconds between progress calls of lane 0 while wire-ups may be under way.
HOT_PUMP_SECONDS = 0.001
# Seconds between progress calls of an idle lane 0.
IDLE_PUMP_SECONDS = 1.0
# Seconds one piece's READ may stay in progress before the lane gives up on it.
READ_TIMEOUT_SECONDS = 10.0

_state: dict[str, Any] = {"runtime": None, "lanes": DEFAULT_LANES}


def configure_nixl_env(tls: str | None = None, lanes: int | None = None) -> dict[str, str]:
    """Prepare this process for the nixl transport (before ``nixl_cu12`` is imported).

    ``tls``: ``UCX_TLS`` for NIXL's bundled UCX (default: what the environment says, else
    UCX's own choice: cma between processes of one PID namespace, rc/dc with an RDMA device,
    TCP otherwise). ``lanes``: the lane threads (agents) the process's runtime will start
    (default ``DEFAULT_LANES``). UCX logs to stderr. ValueError naming the package when it is
    missing.
    """
    require("--transport nixl", NIXL_MODULE)
    if lanes is not None:
        if lanes < 1:
            raise ValueError(f"NIXL lanes={lanes!r}; use 1 or more")
        _state["lanes"] = lanes
    if tls is not None:
        if not tls.strip():
            raise ValueError("--ucx-tls is empty: give UCX transports such as rc,cma,tcp,self")
        os.environ["UCX_TLS"] = tls
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}


def import_nixl() -> Any:
    """The ``nixl_cu12`` module, its Python logger routed to ours (it prints to stdout)."""
    try:
        module = importlib.import_module(NIXL_MODULE)
    except ImportError as exc:
        raise RuntimeError(f"the nixl transport needs NVIDIA NIXL ({exc}): "
                           f"pip install --no-deps {NIXL_PACKAGE}") from exc
    nixl_log = logging.getLogger("nixl")
    nixl_log.handlers.clear()
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)
    return module


# Most piece descriptors prepared for one mapping; past it pieces are described per READ.
MAX_PREPPED_PIECES = 1 << 17


def piece_ranges(nbytes: int, piece: int | None = None) -> list[tuple[int, int]]:
    """``(offset, length)`` of the pieces a chunk of ``nbytes`` is read in (``PIECE_BYTES``)."""
    piece = piece or PIECE_BYTES
    return [(off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]


@dataclass
class SlotTable:
    """Where the pieces of each slot of one mapping are (this process's store, or a holder's
    view of its store), and NIXL's prepared descriptors of them (None past MAX_PREPPED_PIECES)."""

    # Address of slot 0.
    base: int
    # Bytes between slot starts.
    stride: int
    # (offset, length) of the pieces of a slot.
    pieces: list[tuple[int, int]]
    # Prepared descriptor list (index = slot * len(pieces) + piece), or None.
    handle: Any = None

    def address(self, slot: int, piece: int) -> int:
        return self.base + slot * self.stride + self.pieces[piece][0]

    def index(self, slot: int, piece: int) -> int:
        return slot * len(self.pieces) + piece


class LaneError(Exception):
    """A NIXL call on a lane failed (the connection it served is unusable). ``slot_in_use``:
    a READ could not be cancelled, so its destination may still be written: keep it reserved."""

    slot_in_use = False


class Lane:
    """One thread and the NIXL agent only it calls."""

    def __init__(self, runtime: NixlRuntime, index: int, name: str) -> None:
        self.runtime = runtime
        self.index = index
        self.name = name
        # Read jobs submitted and not finished (the loop balances lanes by it).
        self.queued = 0
        self.agent: Any = None
        # Remote agent name -> connections using it (loaded once, forgotten at 0).
        self.remote_refs: dict[str, int] = {}
        self._jobs: queue.SimpleQueue[Callable[[Lane], None] | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvo-nixl-lane-{index}", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"NIXL agent {self.name} did not start: {self._error}") from self._error

    def call(self, fn: Callable[[Lane], Any]) -> asyncio.Future[Any]:
        """Run ``fn(lane)`` in the lane's thread; the loop future gets its result or error."""
        loop = self.runtime.loop
        fut: asyncio.Future[Any] = loop.create_future()

        def job(lane: Lane) -> None:
            try:
                result, error = fn(lane), None
            except BaseException as exc:  # handed to the loop, never lost in the thread
                result, error = None, exc
            loop.call_soon_threadsafe(_settle, fut, result, error)

        self._jobs.put(job)
        return fut

    def post(self, fn: Callable[[Lane], None]) -> None:
        """Run ``fn(lane)`` in the lane's thread, nobody waiting (errors are logged)."""
        def job(lane: Lane) -> None:
            try:
                fn(lane)
            except Exception:
                log.exception("NIXL lane %d: background call failed", lane.index)

        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def prep_table(self, agent_name: str | None, base: int, stride: int, slot_bytes: int,
                   num_slots: int) -> SlotTable:
        """The pieces of ``num_slots`` slots at ``base``, prepared for READs (``agent_name``:
        a holder's view; None: this process's store)."""
        import numpy as np

        table = SlotTable(base, stride, piece_ranges(slot_bytes))
        count = num_slots * len(table.pieces)
        if count <= MAX_PREPPED_PIECES:
            rows = np.zeros((count, 3), dtype=np.uint64)
            slots = np.repeat(np.arange(num_slots, dtype=np.uint64) * np.uint64(stride), len(table.pieces))
            offsets = np.tile(np.array([o for o, _ in table.pieces], dtype=np.uint64), num_slots)
            rows[:, 0] = np.uint64(base) + slots + offsets
            rows[:, 1] = np.tile(np.array([n for _, n in table.pieces], dtype=np.uint64), num_slots)
            table.handle = self.agent.prep_xfer_dlist(agent_name or "NIXL_INIT_AGENT", rows, "DRAM")
        return table

    def read(self, remote: str, local: SlotTable, local_slot: int, far: SlotTable, remote_slot: int,
             view: memoryview, verify: bool) -> int | None:
        """READ slot ``remote_slot`` of the holder ``remote`` (``far``) into ``local_slot`` of
        this store (``local``; ``view`` is that slot) as ONE transfer of all its pieces, then
        hash the slot in one call; returns the XXH3-64 of the whole (None unverified).
        LaneError when the READ fails.

        One transfer and one hash per chunk, not per piece: each NIXL call and each hash
        releases the GIL, and taking it back waits for whatever Python another thread runs
        (up to the switch interval), so per-piece calls made a 32 MiB chunk pay that 128 times.
        """
        import xxhash

        nixl = self.runtime.nixl_bindings
        agent = self.agent
        pieces = range(len(local.pieces))
        try:
            if local.handle is not None and far.handle is not None:
                xfer = agent.make_prepped_xfer(
                    "READ", local.handle, [local.index(local_slot, p) for p in pieces],
                    far.handle, [far.index(remote_slot, p) for p in pieces])
            else:
                xfer = agent.initialize_xfer(
                    "READ",
                    nixl.nixlXferDList(nixl.DRAM_SEG, [(local.address(local_slot, p), n, 0)
                                                       for p, (_, n) in enumerate(local.pieces)]),
                    nixl.nixlXferDList(nixl.DRAM_SEG, [(far.address(remote_slot, p), n, 0)
                                                       for p, (_, n) in enumerate(far.pieces)]),
                    remote)
        except Exception as exc:
            raise LaneError(f"NIXL READ from {remote} failed: {type(exc).__name__}: {exc}") from exc
        status = "ERR"
        try:
            status = agent.transfer(xfer)
            until = time.monotonic() + READ_TIMEOUT_SECONDS
            while status == "PROC" and time.monotonic() < until:  # RDMA; CMA is done in transfer()
                status = agent.check_xfer_state(xfer)
        except Exception as exc:
            status = f"{type(exc).__name__}: {exc}"
        try:
            xfer.release()  # cancels a READ still in progress
        except Exception as exc:
            error = LaneError(f"NIXL READ from {remote} ({status}) could not be released: {exc}")
            error.slot_in_use = status == "PROC"  # the NIC may still write into the slot
            raise error from exc
        if status != "DONE":
            raise LaneError(f"NIXL READ from {remote} ended in state {status}")
        return xxhash.xxh3_64_intdigest(view) if verify else None

    def load_remote(self, metadata: bytes) -> str:
        """Load a holder's (partial) metadata; returns its agent name, counted per connection."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.remote_refs[name] = self.remote_refs.get(name, 0) + 1
        self.agent.make_connection(name)
        return name

    def unload_remote(self, name: str, *, now: bool = False, table: SlotTable | None = None) -> None:
        """One connection to ``name`` (its view ``table``) ended; forget the agent when it was
        the last (``now``: at once, e.g. after a failed read left its endpoint unusable)."""
        if table is not None and table.handle is not None:
            try:
                table.handle.release()
            except Exception as exc:
                log.debug("NIXL lane %d: releasing a view's descriptors: %s", self.index, exc)
            table.handle = None
        left = 0 if now else self.remote_refs.get(name, 0) - 1
        if left > 0:
            self.remote_refs[name] = left
            return
        if self.remote_refs.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # already invalidated by a failure
                log.debug("NIXL lane %d: forgetting %s: %s", self.index, name, exc)

    def _run(self) -> None:
        try:
            nixl = self.runtime.nixl
            config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                            backends=["UCX"])
            self.agent = nixl.nixl_agent(self.name, config)
            if "UCX" not in self.agent.backends:
                raise RuntimeError("NIXL has no UCX backend here")
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        last_pump = 0.0
        while True:
            now = time.monotonic()
            hot = now < self.runtime.hot_until or (
                self.index == 0 and now < self.runtime.serving_hot_until)
            pumps = hot or self.index == 0
            wait = HOT_PUMP_SECONDS if hot else IDLE_PUMP_SECONDS
            if pumps and now - last_pump >= wait:
                try:
                    self.agent.get_new_notifs()
                except Exception as exc:
                    log.debug("NIXL lane 0 progress: %s", exc)
                last_pump = now
            try:
                job = self._jobs.get(timeout=max(wait - (time.monotonic() - last_pump), 0.0)
                                     if pumps else None)
            except queue.Empty:
                continue
            if job is None:
                self.agent = None  # the agent ends in its own thread, before the interpreter does
                return
            job(self)


def _close_at_exit() -> None:
    """NIXL agents must end in their threads before the interpreter tears down (a C++ thread
    destroyed while running aborts the process)."""
    rt, _state["runtime"] = _state["runtime"], None
    if rt is not None:
        rt.close()


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class NixlRuntime:
    """This process's lanes (NIXL agents); one per process, bound to the loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lanes: int = DEFAULT_LANES) -> None:
        if lanes < 1:
            raise ValueError(f"NIXL lanes={lanes!r}; use 1 or more")
        self.loop = loop
        self.nixl = import_nixl()
        self.nixl_bindings = importlib.import_module(f"{NIXL_MODULE}._bindings")
        # Monotonic time until which every lane progresses every HOT_PUMP_SECONDS.
        self.hot_until = 0.0
        # Monotonic time until which lane 0 (the serving agent) progresses that often.
        self.serving_hot_until = 0.0
        prefix = f"kvo-{os.getpid()}-{secrets.token_hex(4)}"
        self.lanes = [Lane(self, i, f"{prefix}-{i}") for i in range(lanes)]
        self._turn = itertools.count()
        # id(store) -> (the store, its slot table per lane).
        self._local: dict[int, tuple[Any, list[SlotTable]]] = {}

    @classmethod
    async def get(cls, lanes: int | None = None) -> NixlRuntime:
        """The process's runtime, created (agents started) at first use, with ``lanes`` lanes
        (default: ``configure_nixl_env``'s)."""
        loop = asyncio.get_running_loop()
        rt = _state["runtime"]
        if rt is None:
            rt = _state["runtime"] = cls(loop, lanes or _state["lanes"])
            atexit.register(_close_at_exit)
            try:
                await loop.run_in_executor(None, lambda: [lane.wait_ready() for lane in rt.lanes])
            except BaseException:
                _state["runtime"] = None
                rt.close()
                raise
        check_loop(rt.loop, "NIXL")
        return rt

    @property
    def serving(self) -> Lane:
        """The lane whose agent registers and exports views of this process's store."""
        return self.lanes[0]

    def wireup_window(self) -> None:
        """Every lane progresses often for the next ``WIREUP_SECONDS`` (a peer is connecting)."""
        self.hot_until = time.monotonic() + WIREUP_SECONDS
        for lane in self.lanes:
            lane.post(lambda lane: None)  # wake it now

    def serving_window(self) -> None:
        """Lane 0 progresses often for the next ``WIREUP_SECONDS``: a FETCH was answered, and
        the fetcher lane that READs it may be wiring its endpoint up to lane 0's agent."""
        now = time.monotonic()
        cold = now >= self.serving_hot_until
        self.serving_hot_until = now + WIREUP_SECONDS
        if cold:
            self.serving.post(lambda lane: None)  # wake it now

    def pick_lane(self) -> Lane:
        """The lane with the fewest read jobs queued (ties in turn)."""
        start = next(self._turn)
        order = [self.lanes[(start + i) % len(self.lanes)] for i in range(len(self.lanes))]
        return min(order, key=lambda lane: lane.queued)

    async def register_local(self, store: Any) -> list[SlotTable]:
        """Register ``store``'s mapping (the fetcher's slots) with every lane; its slot table per lane."""
        entry = self._local.get(id(store))
        if entry is not None and entry[0] is store:
            return entry[1]
        import numpy as np

        view = store.slot_view(0)
        base = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        size = store.num_slots * store.slot_stride

        def register(lane: Lane) -> SlotTable:
            lane.agent.register_memory([(base, size, 0, "")], "DRAM")
            return lane.prep_table(None, base, store.slot_stride, store.slot_bytes, store.num_slots)

        tables = list(await asyncio.gather(*(lane.call(register) for lane in self.lanes)))
        self._local[id(store)] = (store, tables)
        return tables

    def close(self, timeout: float = 5.0) -> None:
        """Stop the lanes (each ends its agent) and wait for them; idempotent."""
        for lane in self.lanes:
            lane.stop()
        for lane in self.lanes:
            lane.join(timeout)
