"""What every data-plane transport shares: the interfaces, auth and fetch bookkeeping.

A data connection carries frames of ``kv_offload_sidecar.data.protocol``. It starts
with the server's 16-byte nonce; the client answers with the session id it got
from the control-plane handshake and HMAC-SHA256(session_key, nonce). Only then
may it send LOOKUP and FETCH. A fetch reserves store slots first
(``store.begin_write``), the transport receives the chunk bytes straight into
``reservation.view`` and commits with the checksum the holder sent; any error,
deadline or closed connection aborts every reservation still open, so a chunk is
in the receiving store whole and verified or not at all.

Connections are persistent and serve concurrent callers; a failed operation
closes the client (raise ``TransportError``), the caller reconnects later.

Before the proof a connection costs its server little and not for long: no frame
longer than ``protocol.MAX_UNAUTHENTICATED_PAYLOAD`` (refused at its header), every
step from accept to AUTH_OK within ``auth_timeout`` (``DEFAULT_AUTH_TIMEOUT``), at most
``MAX_UNAUTHENTICATED_PER_SOURCE`` such connections per source address and
``MAX_UNAUTHENTICATED_CONNECTIONS`` in all (more are refused at accept, counted as
``too_many_connections``; a connection past the deadline as ``timeout``).
Every refusal is counted in ``protocol_errors{reason}``; its log line goes through a
``rejections.RejectionLog`` (one line per source and reason per interval), values clipped.
Once authenticated, none of these limits applies.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import gc
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.rejections import RejectionLog, clip

if TYPE_CHECKING:
    from ssl import SSLContext

    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Returns the session key of an authenticated session id, or None.
Authorize = Callable[[bytes], "bytes | None"]

# Chunks requested but not yet received per fetch (at least).
DEFAULT_WINDOW = 8
# Bytes requested but not yet received per fetch: small chunks get a deeper window.
WINDOW_BYTES = 16 << 20
# Seconds a new connection has for every step before AUTH_OK together (TLS, challenge, proof).
DEFAULT_AUTH_TIMEOUT = 5.0
# Unauthenticated connections one source address may hold at once (a peer opens one per link).
MAX_UNAUTHENTICATED_PER_SOURCE = 8
# Unauthenticated connections a server holds at once from all sources; more are refused.
MAX_UNAUTHENTICATED_CONNECTIONS = 64
# Connections ended without a proof after which, once none is left, the heap is trimmed.
TRIM_AFTER_STRANGERS = 16
# Seconds from the last unauthenticated connection's end to the heap trim (its buffers go first).
TRIM_DELAY_SECONDS = 0.5
# Fewest seconds between two trims: a full garbage collection pauses the loop for milliseconds.
TRIM_INTERVAL_SECONDS = 10.0
# Seconds the server waits for one chunk to leave before giving up on a client.
DEFAULT_SEND_TIMEOUT = 30.0


class TransportError(Exception):
    """A lookup or fetch failed or missed its deadline; the client is closed."""


class IntegrityError(TransportError):
    """A received chunk did not match its checksum; it was not stored."""


class ReservationLike(Protocol):
    """``chunk_store.WriteReservation`` as the transports use it."""

    key: bytes
    view: memoryview

    def commit(self, expected_checksum: int | None = None, *,
               computed_checksum: int | None = None) -> bool: ...
    def abort(self) -> None: ...


class PinLike(Protocol):
    """``chunk_store.PinnedChunk`` as the transports use it."""

    view: memoryview
    checksum: int

    def release(self) -> None: ...


class StoreLike(Protocol):
    """``chunk_store.ChunkStore`` as the transports use it."""

    @property
    def slot_bytes(self) -> int: ...
    def contains(self, key: bytes) -> bool: ...
    def lookup_prefix(self, keys: Sequence[bytes], *, touch: bool = True) -> int: ...
    def begin_write(self, key: bytes) -> ReservationLike | None: ...
    def pin(self, key: bytes) -> PinLike | None: ...


async def wait_until_idle(tasks: Sized, connections: Mapping[Any, Any], grace_seconds: float) -> None:
    """A stopping server's grace: while ``tasks`` (connections being served) remain, wait
    until every one of ``connections`` says ``idle(now)``, for at most ``grace_seconds``."""
    deadline = time.monotonic() + grace_seconds
    while tasks and time.monotonic() < deadline:
        now = time.monotonic()
        if all(c.idle(now) for c in connections.values()):
            return
        await asyncio.sleep(0.05)


def make_nonce() -> bytes:
    """A fresh server challenge."""
    return secrets.token_bytes(proto.NONCE_BYTES)


def auth_proof(session_key: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256(session_key, nonce): the client's answer to the challenge."""
    return hmac.new(session_key, nonce, hashlib.sha256).digest()


def check_auth(authorize: Authorize, nonce: bytes, answer: proto.AuthResponse) -> None:
    """Raise ``ProtocolError('unauthenticated')`` unless the answer proves the session."""
    try:
        key = authorize(answer.session_id)
    except Exception as exc:  # a broken authorize callback must not crash the server
        log.error("data plane: the authorize callback failed: %s", describe(exc),
                  exc_info=log.isEnabledFor(logging.DEBUG))
        raise proto.ProtocolError("unauthenticated", "session check failed") from exc
    if not key or not hmac.compare_digest(auth_proof(key, nonce), answer.proof):
        raise proto.ProtocolError(
            "unauthenticated", "unknown session or wrong proof; handshake again on the control port")


def count_protocol_error(metrics: SidecarMetrics | None, reason: str) -> None:
    """Count one refused frame by reason."""
    if metrics is not None:
        metrics.protocol_errors.labels(reason=reason).inc()


def refuse(metrics: SidecarMetrics | None, rejections: RejectionLog, source: str,
           reason: str, detail: object) -> None:
    """Count one refusal in ``protocol_errors{reason}`` (every event) and note it in the
    rate-limited ``rejections`` log (``detail`` clipped there)."""
    count_protocol_error(metrics, reason)
    rejections.reject(source, reason, detail)


def describe(exc: BaseException) -> str:
    """An unexpected exception as one short line (its type and clipped text, no traceback)."""
    return f"{type(exc).__name__}: {clip(exc)}"


def reclaim_memory() -> bool:
    """Give what departed strangers held back to the system: collect the reference cycles
    their connections left (asyncio's TLS transports sit in cycles until a full collection),
    then trim the C heap (glibc ``malloc_trim``; a freed 256 KiB TLS buffer stays in the heap
    otherwise). False where there is no ``malloc_trim``."""
    gc.collect()
    trim = _MALLOC_TRIM[0]
    if trim is None:
        try:
            trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            trim = False
        _MALLOC_TRIM[0] = trim
    if not trim:
        return False
    trim(0)
    return True


_MALLOC_TRIM: list[Any] = [None]


class UnauthenticatedLimit:
    """Counts a server's connections that have not proved a session yet, per source and in
    all: ``admit(source)`` takes a place or says why not, ``leave(source, proved)`` gives it
    back. Once ``TRIM_AFTER_STRANGERS`` left without a proof and none is left, the memory they
    held goes back to the system (``reclaim_memory``, at most every ``TRIM_INTERVAL_SECONDS``)."""

    def __init__(self, per_source: int = MAX_UNAUTHENTICATED_PER_SOURCE,
                 total: int = MAX_UNAUTHENTICATED_CONNECTIONS) -> None:
        self._per_source = per_source
        self._total = total
        self._by_source: dict[str, int] = {}
        # Unauthenticated connections now.
        self.count = 0
        # Connections that left without a proof since the heap was last trimmed.
        self._strangers = 0
        # Heap trims so far (tests read it).
        self.trims = 0
        self._trim_at: asyncio.TimerHandle | None = None
        self._trimmed = -TRIM_INTERVAL_SECONDS  # monotonic time of the last trim

    def admit(self, source: str) -> str | None:
        """Take a place for a new connection from ``source``; None when admitted, else the
        reason it is refused (nothing taken then)."""
        if self.count >= self._total:
            return f"too many unauthenticated connections ({self._total} from all sources)"
        held = self._by_source.get(source, 0)
        if held >= self._per_source:
            return f"too many unauthenticated connections from one address ({self._per_source})"
        self._by_source[source] = held + 1
        self.count += 1
        return None

    def leave(self, source: str, proved: bool) -> None:
        """The connection from ``source`` authenticated (``proved``) or ended without a proof."""
        held = self._by_source.get(source, 0)
        if held <= 1:
            self._by_source.pop(source, None)
        else:
            self._by_source[source] = held - 1
        self.count = max(0, self.count - 1)
        if not proved:
            self._strangers += 1
        if self.count == 0 and self._strangers >= TRIM_AFTER_STRANGERS and self._trim_at is None:
            # Later: a closed TLS transport frees its buffers a few loop passes after close().
            delay = max(TRIM_DELAY_SECONDS, self._trimmed + TRIM_INTERVAL_SECONDS - time.monotonic())
            self._trim_at = asyncio.get_running_loop().call_later(delay, self._trim)

    def _trim(self) -> None:
        self._trim_at = None
        if self.count == 0:  # else the next stranger to leave the last place schedules it again
            self._strangers = 0
            self._trimmed = time.monotonic()
            self.trims += reclaim_memory()


# Schemes of data addresses: plain TCP, TCP under TLS, UCX, NIXL (its TCP control port).
ADDRESS_SCHEMES = ("tcp", "tls", "ucx", "nixl")


def parse_address(address: str) -> tuple[str, str]:
    """Split ``scheme://rest``; the scheme picks the transport (``tls`` is the TCP one, encrypted)."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ADDRESS_SCHEMES or not rest:
        raise ValueError(f"data address {address!r} is not tcp://host:port, tls://host:port, "
                         "ucx://<worker address> or nixl://host:port")
    return scheme, rest


def check_tls_policy(address: str, scheme: str, ssl: SSLContext | None) -> None:
    """TransportError unless this pod's TLS setting (``ssl``) and the peer's scheme agree."""
    if scheme == "tls" and ssl is None:
        raise TransportError(f"peer {address} encrypts its data plane (TLS) and this pod does not: "
                             "give this sidecar --tls-cert-file, --tls-key-file and --tls-ca-file "
                             "(a certificate of the pool's CA)")
    if scheme != "tls" and ssl is not None:
        serves = {"tcp": "plain TCP", "ucx": "UCX, which is not encrypted",
                  "nixl": "NIXL one-sided reads, which are not encrypted"}.get(scheme, scheme)
        raise TransportError(f"this pod requires TLS; peer {address} serves {serves} on its data plane "
                             "and is not dialled: give every pool member the --tls-* flags (and --transport tcp)")


class DataPlaneServer(abc.ABC):
    """Serves this sidecar's chunks to authenticated peers."""

    @abc.abstractmethod
    async def start(self) -> str:
        """Start serving; return the address to advertise in the handshake."""

    @abc.abstractmethod
    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop accepting, let sends in flight finish for up to ``grace_seconds``, close."""


class PeerDataClient(abc.ABC):
    """One authenticated connection to a peer's data plane."""

    @abc.abstractmethod
    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        """Number of leading ``keys`` the peer holds."""

    @abc.abstractmethod
    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float) -> int:
        """Copy chunks into ``store``; return the number of leading keys now visible there.
        A fetch marked ``takes_count`` also takes ``count=`` and ``first=`` (``run_fetch``)."""

    async def fetch_counted(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                            first: int, on_count: Callable[[int], None]) -> int:
        """One exchange with the holder: the LOOKUP of ``keys`` leaves first and the FETCH of
        the first ``first`` keys right behind it, on this connection; ``on_count`` gets the
        holder's hit prefix as soon as it arrives (before the chunks), and no key past it is
        requested. Returns the leading keys now visible in ``store``. (A transport whose fetch is
        not marked ``takes_count`` asks first and fetches the count after.)"""
        self._check_open()
        count = asyncio.ensure_future(self.lookup(keys, timeout))
        reported = False

        def report(f: asyncio.Future[int]) -> None:
            nonlocal reported
            if not reported and not f.cancelled() and f.exception() is None:
                reported = True
                on_count(f.result())

        count.add_done_callback(report)
        await asyncio.sleep(0)  # the LOOKUP goes out first
        try:
            if not getattr(type(self).fetch, "takes_count", False):
                n = await count
                return await self.fetch(keys[:n], store, timeout) if n else 0
            got = await self.fetch(keys, store, timeout, count=count, first=first)  # type: ignore[call-arg]
            await count  # answered before any chunk frame
            report(count)  # now, if its callback has not run yet
            return got
        finally:
            if not count.done():
                count.cancel()
            elif not count.cancelled():
                count.exception()  # retrieved: its failure already failed the fetch

    @abc.abstractmethod
    async def close(self) -> None:
        """Say goodbye and close; idempotent."""

    # The error that ended the connection; None while it is usable.
    _error: BaseException | None = None

    @property
    def closed(self) -> bool:
        """True once the connection is gone (after an error, a deadline or close())."""
        return self._error is not None

    def _check_open(self) -> None:
        if self._error is not None:
            raise TransportError(f"data connection is closed: {self._error}")


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
    ``first`` keys until it arrives and none past it after. Returns the leading keys
    visible at the end. On any failure or deadline
    calls ``fail(exc)`` (the transport closes the connection, so nothing writes
    into the slots any more) and aborts every open reservation.
    """
    plan = FetchPlan(list(keys))
    window = max(window, WINDOW_BYTES // max(store.slot_bytes, 1))
    started = time.monotonic()
    next_index = 0
    stop_at = len(plan.keys)
    result = "ok"
    landed: list[int] = []  # indices whose future completed, in completion order
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
                    batch.append((next_index, PendingChunk(key, res, fut, store.slot_bytes)))
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
    except BaseException as err:
        _fail_plan(plan, fail, err)
        _observe(metrics, "error", started)
        if isinstance(err, (TransportError, asyncio.CancelledError)):
            raise
        raise TransportError(f"fetch failed: {err}") from err
    n = plan.prefix()
    for i, key in enumerate(plan.keys[:n]):  # a store smaller than the fetch may have evicted some
        if not store.contains(key):
            n = i
            break
    wanted = len(plan.keys)  # all of them; with a count, as many as the holder said it holds
    if count is not None and count.done() and not count.cancelled() and count.exception() is None:
        wanted = min(wanted, count.result())
    _observe(metrics, "ok" if n >= wanted else "miss", started)
    return n


def _fail_plan(plan: FetchPlan, fail: Callable[[BaseException], object], exc: BaseException) -> None:
    fail(exc)  # closes the connection first: nothing writes into the slots after this
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
    ok = p.reservation.commit(checksum, computed_checksum=computed)
    if p.done.done():  # the fetch gave up meanwhile; the chunk is whole and verified anyway
        return
    if ok:
        p.committed = True
        if metrics is not None:
            metrics.peer_bytes.labels(direction="received").inc(p.nbytes)
        p.done.set_result(True)
    else:
        p.done.set_exception(IntegrityError(
            f"chunk {p.key.hex()} failed its checksum; not stored (peer sent corrupt data)"))

