"""What the planes' clients share: one connection to a holder that speaks the data
protocol's frames, with its lookups and chunk requests in flight.

``FramedPeerDataClient`` keeps the request bookkeeping (lookups waiting for their
LOOKUP_REPLY, chunks requested and not yet in), runs a fetch through the fetch engine
(``fetch.run_fetch``, ``fetch.lookup_then_fetch``), says CLOSE, and fails everything in
flight when the connection ends. A plane keeps only how bytes move: ``_send`` (one frame
out), ``_rids`` (its request ids), ``_request_chunks`` (ask for a batch, with the slots to
receive into), the reader task that answers the futures, and what ending the connection
means for it (``_connection_failed``). ``heard_at`` is the monotonic time of the last frame
the reader took from the holder; ``ping`` is the links' heartbeat (``peers.liveness``): an
empty LOOKUP, which every plane's server answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import PeerBusy, PeerDataClient, StoreLike, TransportError
from kv_offload_sidecar.data.fetch import PendingChunk, lookup_then_fetch, run_fetch

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics


class FramedPeerDataClient(PeerDataClient):
    """One authenticated connection to a peer's data plane, requests in flight by request id."""

    # Errors of sending a LOOKUP that fail the connection (as TransportError); others propagate.
    _send_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, metrics: SidecarMetrics | None, window: int) -> None:
        self._metrics = metrics
        self._window = window
        self._next_rid = 1
        # Request id -> the requested chunk (a plane may keep more per chunk, see _in_flight).
        self._chunks: dict[int, Any] = {}
        # Request id -> (the lookup's future, keys asked).
        self._lookups: dict[int, tuple[asyncio.Future[int], int]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        # Monotonic time of the last frame from the holder (the reader sets it).
        self.heard_at = time.monotonic()

    async def _send(self, frame: list) -> None:
        """Send one frame (a list of buffers) to the holder."""
        raise NotImplementedError

    def _rids(self, n: int) -> int:
        """The first of ``n`` consecutive fresh request ids."""
        raise NotImplementedError

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        """Ask the holder for ``batch`` (the fetch engine's ``send_requests``)."""
        raise NotImplementedError

    def _lookup_reply_now(self, rid: int, asked: int, timeout: float) -> int | None:
        """This lookup's count when the plane can take its reply at once, without the reader
        task; None (the default) waits for the reader to answer the future."""
        return None

    def _in_flight(self) -> Iterable[PendingChunk]:
        """The chunks requested and not yet in."""
        return self._chunks.values()

    def _connection_failed(self, err: TransportError) -> None:
        """The connection just ended with ``err`` (called once, before anything in flight is
        failed): stop the transport writing into slots."""

    @contextlib.asynccontextmanager
    async def _answered(self, asked: int, what: str, late: str,
                        rid: int | None = None) -> AsyncIterator[tuple[int, asyncio.Future[int]]]:
        """A LOOKUP of ``asked`` keys in flight: its request id (``rid``, else a new one) and the
        future its reply answers. A timeout in the block fails the connection with ``late``, an
        error of sending with ``what`` failed; the request is forgotten and its future's error
        retrieved at the end."""
        rid = self._rids(1) if rid is None else rid
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._lookups[rid] = (fut, asked)
        try:
            yield rid, fut
        except TimeoutError:
            exc = TransportError(late)
            self._fail(exc)
            raise exc from None
        except TransportError:
            raise
        except self._send_errors as exc:
            self._fail(exc)
            raise TransportError(f"{what} failed: {exc}") from exc
        finally:
            self._lookups.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed with the connection: retrieved (no "never retrieved" log)

    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        """Number of leading ``keys`` the peer holds (one LOOKUP round trip)."""
        self._check_open()
        keys = list(keys)
        if not keys:
            return 0
        async with self._answered(len(keys), "lookup",
                                  f"lookup of {len(keys)} keys missed its {timeout:.3g}s deadline") as (rid, fut):
            async with asyncio.timeout(timeout):
                await self._send(proto.encode_lookup(rid, keys))
                count = self._lookup_reply_now(rid, len(keys), timeout)
                return count if count is not None else await fut

    async def ping(self, silence: float) -> float:
        """One heartbeat: an empty LOOKUP; its round trip in seconds. When nothing at all came
        from the holder for ``silence`` seconds after it left, the connection fails
        (TransportError): a pong late behind chunks still arriving is no failure."""
        self._check_open()
        async with self._answered(0, "heartbeat",
                                  f"peer silent: no frame for {silence:.3g}s after a heartbeat") as (rid, fut):
            sent = time.monotonic()
            await self._send(proto.encode_lookup(rid, []))
            await answer_or_silence(fut, lambda: self.heard_at, silence)
            return time.monotonic() - sent

    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                    count: asyncio.Future[int] | None = None, first: int = 1) -> int:
        """Receive chunks straight into ``store`` slots; leading keys now visible (``count``,
        ``first``: the LOOKUP answer ``fetch_counted`` sent just before, see ``run_fetch``)."""
        self._check_open()
        return await run_fetch(keys, store, timeout, window=self._window,
                               send_requests=self._request_chunks, fail=self._fail,
                               metrics=self._metrics, count=count, first=first)

    async def fetch_counted(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                            first: int, on_count: Callable[[int], None]) -> int:
        """The LOOKUP of ``keys`` and, right behind it, the FETCH (see ``PeerDataClient``)."""
        self._check_open()
        return await lookup_then_fetch(
            self.lookup(keys, timeout),
            lambda count: self.fetch(keys, store, timeout, count=count, first=first), on_count)

    async def close(self) -> None:
        """Send CLOSE (best effort) and close the connection."""
        if self._error is not None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.5):
                await self._send(proto.encode_close())
        self._fail(TransportError("closed by this side"))
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                await self._reader

    def _fail(self, exc: BaseException) -> None:
        """End the connection and fail every request in flight (idempotent)."""
        first = self._error is None
        err = exc if isinstance(exc, TransportError) else TransportError(f"data connection failed: {exc}")
        if first:
            self._error = exc
            self._connection_failed(err)
        for p in self._in_flight():
            if not p.done.done():
                p.done.set_exception(err)
        self._chunks.clear()
        for fut, _ in self._lookups.values():
            if not fut.done():
                fut.set_exception(err)
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task() and not reader.done():
            reader.cancel()


class AnswerGivenUp(TimeoutError):
    """``answer_or_silence`` stopped waiting; ``reason`` is "silence" (nothing heard from the peer
    for the silence) or "deadline" (the wait's bound passed, the peer heard or not)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"no answer: {reason}")
        self.reason = reason


async def answer_or_silence(fut: asyncio.Future[Any], heard: Callable[[], float], silence: float,
                            within: float = float("inf"), since: float | None = None) -> Any:
    """``fut``'s result, waited for while the peer is heard from: AnswerGivenUp (a TimeoutError)
    once nothing came from it (``heard()``, the monotonic time of its last frame) for ``silence``
    seconds since this call or its last frame, or after ``within`` seconds at most; from
    ``since`` instead (an earlier question to the peer) while nothing came from it after that.
    ``fut`` is not cancelled. Before giving up the loop takes a turn, so a frame that arrived
    while this loop was busy is read first."""
    asked = time.monotonic()
    limit = asked + within
    since = asked if since is None else min(since, asked)

    def end() -> float:
        last = heard()
        return min(max(asked if last >= since else since, last) + silence, limit)

    while True:
        now = time.monotonic()
        if end() <= now:
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            now = time.monotonic()
            if not fut.done() and end() <= now:
                raise AnswerGivenUp("deadline" if now >= limit else "silence")
        if fut.done():
            return fut.result()
        await asyncio.wait({fut}, timeout=max(0.0, end() - now))


def raise_if_refused(header: proto.Header, payload: bytes | bytearray | memoryview | None) -> None:
    """TransportError when the holder's frame is an ERROR (it refused) or a CLOSE."""
    if header.type is proto.MessageType.ERROR:
        text = proto.decode_error(payload or b"")
        busy = text.startswith("too_many_connections")
        raise (PeerBusy if busy else TransportError)(f"peer refused: {text}")
    if header.type is proto.MessageType.CLOSE:
        raise TransportError("peer closed the data connection")


def challenge_nonce(header: proto.Header, payload: bytes | bytearray | memoryview | None) -> bytes:
    """The nonce of the holder's AUTH_CHALLENGE, the first frame of a connection."""
    raise_if_refused(header, payload)
    if header.type is not proto.MessageType.AUTH_CHALLENGE or payload is None:
        raise proto.ProtocolError("malformed", f"expected AUTH_CHALLENGE, got {header.type.name}")
    return proto.decode_auth_challenge(payload)


def check_auth_ok(header: proto.Header, payload: bytes | bytearray | memoryview | None) -> None:
    """Return when the holder's answer to the proof is AUTH_OK; raise otherwise."""
    raise_if_refused(header, payload)
    if header.type is not proto.MessageType.AUTH_OK or payload is None:
        raise proto.ProtocolError("malformed", f"expected AUTH_OK, got {header.type.name}")
    proto.decode_auth_ok(payload)
