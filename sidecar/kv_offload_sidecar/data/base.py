"""The data plane's contract: the interfaces every transport implements, and its proof.

A data connection carries frames of ``kv_offload_sidecar.data.protocol``. It starts
with the server's 16-byte nonce; the client answers with the session id it got
from the control-plane handshake and HMAC-SHA256(session_key, nonce) (``auth_proof``,
checked by ``serving.check_auth``). Only then may it send LOOKUP and FETCH. A fetch reserves
store slots first (``store.begin_write``), the transport receives the chunk bytes
straight into ``reservation.view`` (TCP: into ``reservation.receive_view``, which may be
an offered row of vLLM's, ``peers.row_landings``) and commits with the checksum the holder sent; any
error, deadline or closed connection aborts every reservation still open, so a chunk is
in the receiving store whole and verified or not at all.

Connections are persistent and serve concurrent callers; a failed operation
closes the client (raise ``TransportError``), the caller reconnects later.

The rest lives beside it: what a connection may cost its server before the proof in
``before_auth.py``, what the servers share in ``serving.py``, the fetch engine in
``fetch.py``, what the clients share (their requests in flight) in ``peer_client.py``, data
addresses in ``address.py``, which plane serves and dials in ``planes.py``.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kv_offload_sidecar.data.write_gates import WriteGate
    from kv_offload_sidecar.metrics import SidecarMetrics

# Returns the session key of an authenticated session id, or None.
Authorize = Callable[[bytes], "bytes | None"]


class TransportError(Exception):
    """A lookup or fetch failed or missed its deadline; the client is closed."""


class PeerBusy(TransportError):
    """The holder refused a new data connection for its bounds (``too_many_connections``): it
    is serving as many as it may, not failing; ask again later."""


class IntegrityError(TransportError):
    """A received chunk did not match its checksum; it was not stored."""


class ReceiveStopped(TransportError):
    """This side ended the connection mid-chunk: the load job that offered the chunk's row
    (``peers.row_landings``) ended first, or the fetch reached its deadline while the bytes
    were still coming (``write_gates.LateWrite``). Not the holder's fault."""


class CommitRefused(ReceiveStopped):
    """A chunk arrived whole but this side could not store it (the store closed, its
    reservation or its row's load job ended first): not the holder's fault."""


class ReservationLike(Protocol):
    """``chunk_store.WriteReservation`` as the transports use it."""

    key: bytes
    view: memoryview

    def receive_view(self, stop: Callable[[], None], gate: WriteGate | None = None) -> memoryview: ...
    def commit(self, expected_checksum: int | None = None, *,
               computed_checksum: int | None = None) -> bool: ...
    def abort(self) -> None: ...


class PinLike(Protocol):
    """``chunk_store.PinnedChunk`` as the transports use it."""

    view: memoryview
    checksum: int

    def release(self) -> None: ...


class StoreLike(Protocol):
    """``chunk_store.ChunkStore`` as the transports use it. ``lookup_prefix`` must be
    thread-safe: the TCP holder calls it on a connection's lookup thread (``tcp.lookup_thread``)."""

    @property
    def slot_bytes(self) -> int: ...
    def contains(self, key: bytes) -> bool: ...
    def lookup_prefix(self, keys: Sequence[bytes], *, touch: bool = True) -> int: ...
    def begin_write(self, key: bytes) -> ReservationLike | None: ...
    def pin(self, key: bytes) -> PinLike | None: ...


def commit_failure(reservation: object) -> str | None:
    """Why ``reservation``'s failed commit was this side's doing (its ``refused``: the store
    closed, the reservation or the row's job ended first); None when the bytes failed their
    checksum, the holder's fault."""
    return getattr(reservation, "refused", None)


def auth_proof(session_key: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256(session_key, nonce): the client's answer to the challenge."""
    return hmac.new(session_key, nonce, hashlib.sha256).digest()


def check_loop(bound: asyncio.AbstractEventLoop, transport: str) -> None:
    """Raise unless the running loop is ``bound``: the one a process-wide runtime of
    ``transport`` was made on (the first asyncio loop that used it)."""
    if asyncio.get_running_loop() is not bound:
        raise RuntimeError(f"the {transport} transport is bound to the first asyncio loop that used it; "
                           "run one event loop per process")


def count_protocol_error(metrics: SidecarMetrics | None, reason: str) -> None:
    """Count one refused frame by reason."""
    if metrics is not None:
        metrics.protocol_errors.labels(reason=reason).inc()


class DataPlaneServer(abc.ABC):
    """Serves this sidecar's chunks to authenticated peers."""

    def __init__(self, store: StoreLike, authorize: Authorize, metrics: SidecarMetrics | None, *,
                 chunk_bytes: int, auth_timeout: float, send_timeout: float) -> None:
        if chunk_bytes != store.slot_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} differs from the store's slot_bytes="
                             f"{store.slot_bytes}; pass the pool's kv_bytes_per_chunk to both")
        self._store = store
        self._authorize = authorize
        self._metrics = metrics
        self._chunk_bytes = chunk_bytes
        self._auth_timeout = auth_timeout
        self._send_timeout = send_timeout

    @abc.abstractmethod
    async def start(self) -> str:
        """Start serving; return the address to advertise in the handshake."""

    @abc.abstractmethod
    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop accepting, let sends in flight finish for up to ``grace_seconds``, close."""


class PeerDataClient(abc.ABC):
    """One authenticated connection to a peer's data plane."""

    # Whether the plane decides where a chunk's bytes go at its first byte
    # (``reservation.receive_view``), so a chunk may land in a row a load job offered
    # (``peers.row_landings``); a plane that places its reads when it requests them does not.
    receives_into_offered_rows = False

    @abc.abstractmethod
    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        """Number of leading ``keys`` the peer holds."""

    @abc.abstractmethod
    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                    count: asyncio.Future[int] | None = None, first: int = 1) -> int:
        """Copy chunks into ``store``; return the number of leading keys now visible there.
        With ``count`` (the answer of the LOOKUP ``fetch_counted`` sent just before), at most
        ``first`` keys are requested until it arrives and none past it (``fetch.run_fetch``)."""

    @abc.abstractmethod
    async def fetch_counted(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                            first: int, on_count: Callable[[int], None]) -> int:
        """One exchange with the holder: the LOOKUP of ``keys`` leaves first and the FETCH of
        the first ``first`` keys right behind it, on this connection; ``on_count`` gets the
        holder's hit prefix as soon as it arrives (before the chunks), and no key past it is
        requested. Returns the leading keys now visible in ``store``."""

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
