"""The fetch engine, the client side of a fetch shared by the transports: a window of reserved
slots, each chunk committed only whole and verified (``commit_received``), every reservation
still open aborted on any failure or deadline (``run_fetch``); a LOOKUP with its FETCH right
behind it, the count bounding the fetch as soon as it arrives (``lookup_then_fetch``); and the
LOOKUP_REPLY bookkeeping.

Contract:
- Each requested chunk carries a ``write_gates.WriteGate`` with the fetch's deadline
  (``PendingChunk.gate``): a transport writes into the chunk's slot (or the row it lands in)
  only under it, so no write starts past the deadline even while the event loop is late; a
  failed fetch revokes every gate before it aborts the reservations (no write is then in
  progress, none comes later: the slots may be reused).
- A commit that fails is the holder's fault (``IntegrityError``, counted as an integrity
  failure) only when the bytes failed their checksum; one that fails for a reason of this
  side's (the store closed, the reservation or the row's job ended first) fails the chunk
  with ``CommitRefused``, a ``ReceiveStopped``: the holder is not blamed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import (
    CommitRefused,
    IntegrityError,
    ReservationLike,
    StoreLike,
    TransportError,
    commit_failure,
)
from kv_offload_sidecar.data.write_gates import WriteGate

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

# Chunks requested but not yet received per fetch (at least).
DEFAULT_WINDOW = 8
# Bytes requested but not yet received per fetch: small chunks get a deeper window.
WINDOW_BYTES = 16 << 20


@dataclass
class PendingChunk:
    """One requested chunk: its slot reservation and the future its receiver completes."""

    # Requested key.
    key: bytes
    # Slot the bytes go to.
    reservation: ReservationLike
    # Resolves True (committed), False (peer does not hold it) or with an exception.
    done: asyncio.Future[bool]
    # Bytes of the chunk (the store's slot_bytes).
    nbytes: int
    # True once the reservation was committed.
    committed: bool = False
    # The right to write into the chunk's slot or row, until the fetch's deadline.
    gate: WriteGate = field(default_factory=WriteGate)


@dataclass
class FetchPlan:
    """Bookkeeping of one fetch call: which keys are present, requested or failed."""

    # Keys asked for, in order.
    keys: list[bytes]
    # Index -> state: True present/committed, False missing; absent = not finished.
    results: dict[int, bool] = field(default_factory=dict)
    # Index -> pending chunk, for the requests in flight.
    pending: dict[int, PendingChunk] = field(default_factory=dict)

    def prefix(self) -> int:
        """Leading keys present."""
        n = 0
        while self.results.get(n):
            n += 1
        return n


async def run_fetch(
    keys: Sequence[bytes],
    store: StoreLike,
    timeout: float,
    *,
    window: int,
    send_requests: Callable[[list[tuple[int, PendingChunk]]], "asyncio.Future[None] | object"],
    fail: Callable[[BaseException], "object"],
    metrics: SidecarMetrics | None,
    count: asyncio.Future[int] | None = None,
    first: int = 1,
) -> int:
    """The client side of a fetch, shared by the transports.

    Keeps up to ``max(window, WINDOW_BYTES / chunk)`` chunks in flight: reserves a slot per key, asks the
    transport to request a batch (``send_requests`` gets ``(index, pending)`` pairs,
    awaitable), and waits for the receiver to resolve each ``pending.done``.
    Keys already visible are not requested. Stops requesting at the first key
    that is missing at the peer, or that cannot get a slot even with nothing in
    flight. With ``count`` (the answer of a LOOKUP sent just before), requests at most
    ``first`` keys until it arrives and none past it after. Returns the number of leading
    keys this fetch landed or found visible. On any failure or deadline
    calls ``fail(exc)`` (the transport closes the connection, so nothing writes
    into the slots any more) and aborts every open reservation; a cancel once every
    chunk asked for is in (a load that holds them all) leaves the connection open.
    """
    plan = FetchPlan(list(keys))
    window = max(window, WINDOW_BYTES // max(store.slot_bytes, 1))
    started = time.monotonic()
    deadline = started + timeout  # the writers' own (``PendingChunk.gate``), loop or no loop
    next_index = 0
    stop_at = len(plan.keys)
    result = "ok"
    landed: list[int] = []  # indices whose future completed, in completion order
    first_landed = True  # no chunk of this fetch committed yet
    wake = asyncio.Event()

    def on_done(i: int) -> Callable[[asyncio.Future[bool]], None]:
        def callback(_f: asyncio.Future[bool]) -> None:
            landed.append(i)
            wake.set()
        return callback

    counted = count is None
    if count is not None:
        count.add_done_callback(lambda _f: wake.set())

    def limit() -> int:
        """Keys that may be requested now: all until stop_at, or as far as the count allows."""
        nonlocal counted, stop_at
        if count is None:
            return stop_at
        if count.done():
            if not counted:
                counted = True
                stop_at = min(stop_at, count.result())  # a failed LOOKUP raises here
            return stop_at
        return min(stop_at, max(1, first))

    try:
        async with asyncio.timeout(timeout):
            while True:
                batch: list[tuple[int, PendingChunk]] = []
                while next_index < limit() and len(plan.pending) + len(batch) < window:
                    key = plan.keys[next_index]
                    res = store.begin_write(key)
                    if res is None:
                        if store.contains(key):
                            plan.results[next_index] = True
                            next_index += 1
                            continue
                        if not (plan.pending or batch):
                            stop_at = next_index  # no slot even with nothing in flight: stop here
                        break  # else retry once a chunk in flight lands (it becomes evictable)
                    fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                    batch.append((next_index, PendingChunk(key, res, fut, store.slot_bytes,
                                                           gate=WriteGate(deadline))))
                    next_index += 1
                if batch:
                    for i, p in batch:
                        plan.pending[i] = p
                        p.done.add_done_callback(on_done(i))
                    await send_requests(batch)  # type: ignore[misc]
                if not plan.pending:
                    if counted or next_index >= stop_at:
                        break
                    await asyncio.shield(count)  # type: ignore[arg-type]  # nothing in flight: wait for the count
                    continue
                while not landed and (counted or not count.done()):  # type: ignore[union-attr]
                    wake.clear()
                    await wake.wait()
                while landed:
                    i = landed.pop(0)
                    p = plan.pending[i]
                    ok = p.done.result()  # raises the receiver's error (p stays pending: aborted)
                    del plan.pending[i]
                    plan.results[i] = ok
                    if not ok:
                        stop_at = min(stop_at, i + 1)
                    elif first_landed and metrics is not None:  # the fixed cost before bytes move
                        first_landed = False
                        metrics.peer_fetch_first_chunk.observe(time.monotonic() - started)
    except TimeoutError:
        result = "timeout"
        exc: BaseException = TransportError(
            f"fetch of {len(plan.keys)} chunks missed its {timeout:.3g}s deadline "
            f"({plan.prefix()} received)")
        _fail_plan(plan, fail, exc)
        _observe(metrics, result, started)
        raise exc from None
    except IntegrityError as err:
        _fail_plan(plan, fail, err)
        _observe(metrics, "integrity", started)
        raise
    except asyncio.CancelledError as err:
        if any(not p.done.done() for p in plan.pending.values()):
            _fail_plan(plan, fail, err)  # bytes may still land in a slot: the connection ends
            _observe(metrics, "error", started)
        else:  # every chunk asked for is in (a load that had them all stopped waiting): the
            plan.pending.clear()  # connection keeps serving; tearing it down costs a reconnect
            _observe(metrics, "ok", started)
        raise
    except BaseException as err:
        _fail_plan(plan, fail, err)
        _observe(metrics, "error", started)
        if isinstance(err, (TransportError, asyncio.CancelledError)):
            raise
        raise TransportError(f"fetch failed: {err}") from err
    # Counted as they came, not as the store holds them now: a lane's thread commits a chunk
    # (visible at once) before this task hears of it, so a load may have taken the fetch's
    # last chunks and let go of them (``shared_loads``) by now; they were fetched all the same.
    n = plan.prefix()
    wanted = len(plan.keys)  # all of them; with a count, as many as the holder said it holds
    if count is not None and count.done() and not count.cancelled() and count.exception() is None:
        wanted = min(wanted, count.result())
    _observe(metrics, "ok" if n >= wanted else "miss", started)
    return n


async def lookup_then_fetch(lookup: Coroutine[Any, Any, int],
                            fetch: Callable[[asyncio.Future[int]], Awaitable[int]],
                            on_count: Callable[[int], None]) -> int:
    """One exchange with the holder: ``lookup`` (its LOOKUP) goes out first and ``fetch``
    (given the lookup's future as ``count``, see ``run_fetch``) right behind it, on one
    connection; ``on_count`` gets the holder's hit prefix as soon as it arrives (before the
    chunks). Returns what ``fetch`` returns; a failed lookup fails the fetch."""
    count = asyncio.ensure_future(lookup)
    reported = False

    def report(f: asyncio.Future[int]) -> None:
        nonlocal reported
        if not reported and not f.cancelled() and f.exception() is None:
            reported = True
            on_count(f.result())

    count.add_done_callback(report)
    await asyncio.sleep(0)  # the LOOKUP goes out first
    try:
        got = await fetch(count)
        await count  # answered before any chunk frame
        report(count)  # now, if its callback has not run yet
        return got
    finally:
        if not count.done():
            count.cancel()
        elif not count.cancelled():
            count.exception()  # retrieved: its failure already failed the fetch


def _fail_plan(plan: FetchPlan, fail: Callable[[BaseException], object], exc: BaseException) -> None:
    for p in plan.pending.values():
        p.gate.revoke()  # no write into a slot or row is under way, and none starts
    fail(exc)  # closes the connection: nothing writes into the slots after this
    for p in plan.pending.values():
        if not p.committed:
            p.reservation.abort()
        if not p.done.done():
            p.done.cancel()
        elif not p.done.cancelled():
            p.done.exception()  # mark retrieved
    plan.pending.clear()


def _observe(metrics: SidecarMetrics | None, result: str, started: float) -> None:
    if metrics is None:
        return
    metrics.peer_fetches.labels(result=result).inc()
    metrics.peer_fetch_duration.observe(time.monotonic() - started)


def answer_lookup(lookups: dict[int, tuple[asyncio.Future[int], int]], request_id: int,
                  payload: memoryview | bytes | bytearray) -> None:
    """Resolve the lookup waiting under ``request_id`` with the LOOKUP_REPLY ``payload``
    (a reply whose caller gave up is ignored; a bad count raises ProtocolError)."""
    entry = lookups.pop(request_id, None)
    if entry is None:
        return
    fut, asked = entry
    count = proto.decode_lookup_reply(payload, asked)
    if not fut.done():
        fut.set_result(count)


def commit_received(p: PendingChunk, checksum: int, metrics: SidecarMetrics | None,
                    computed: int | None = None) -> None:
    """Verify and publish a fully received chunk, resolving its future (``computed``: the
    checksum the transport already took over the slot's bytes, see ``commit``)."""
    error = commit_outcome(p, checksum, metrics, computed)
    if p.done.done():  # the fetch gave up meanwhile; the chunk is whole and verified anyway
        return
    if error is None:
        p.done.set_result(True)
    else:
        p.done.set_exception(error)


def commit_outcome(p: PendingChunk, checksum: int, metrics: SidecarMetrics | None,
                   computed: int | None = None) -> BaseException | None:
    """(Any thread: the reservation's commit and the metrics are thread-safe.) Verify and
    publish a fully received chunk: None when committed, else the error its future gets
    (``commit_received`` resolves it; a transport committing on its own thread hands it to the
    loop)."""
    ok = p.reservation.commit(checksum, computed_checksum=computed)
    if ok:
        p.committed = True
        if metrics is not None:
            metrics.peer_bytes.labels(direction="received").inc(p.nbytes)
        return None
    local = commit_failure(p.reservation)
    if local is None:
        return IntegrityError(f"chunk {p.key.hex()} failed its checksum; not stored (peer sent corrupt data)")
    return CommitRefused(f"chunk {p.key.hex()} arrived whole but was not stored: {local} (this side's doing, "
                         "not the peer's)")
