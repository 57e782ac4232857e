"""The TCP data-plane client: lookups and windowed fetches to one peer, chunk bytes
received straight into reserved store slots and committed only once their checksum matches.

A ``tls://`` address takes an ``ssl`` client context (mutual TLS, then the same session
HMAC inside); a pod with a context refuses ``tcp://`` peers, so a TLS pool never sends KV
in the clear.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl as ssl_module
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import (
    PeerDataClient,
    StoreLike,
    TransportError,
    auth_proof,
    check_tls_policy,
    count_protocol_error,
    parse_address,
)
from kv_offload_sidecar.data.fetch import (
    DEFAULT_WINDOW,
    PendingChunk,
    answer_lookup,
    commit_received,
    run_fetch,
)
from kv_offload_sidecar.data.tcp.sockets import (
    SOCKET_BUFFER_BYTES,
    DataStream,
    SocketStream,
    poll_readable,
    read_frame,
    split_host_port,
    tune_socket,
)
from kv_offload_sidecar.data.tcp.tls_stream import open_tls
from kv_offload_sidecar.rejections import clip

if TYPE_CHECKING:
    from ssl import SSLContext

    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)


# Chunk bytes the client lets arrive before the loop wakes up to take them (SO_RCVLOWAT).
RECV_BATCH_BYTES = 512 << 10


# Seconds a lookup with nothing else in flight polls for its reply before sleeping.
LOOKUP_SPIN_SECONDS = 200e-6


class TcpPeerDataClient(PeerDataClient):
    """An authenticated TCP connection to one peer's data plane."""

    def __init__(self, stream: DataStream, metrics: SidecarMetrics | None, window: int) -> None:
        self._stream = stream
        self._metrics = metrics
        self._window = window
        self._next_rid = 1
        self._chunks: dict[int, PendingChunk] = {}
        self._lookups: dict[int, tuple[asyncio.Future[int], int]] = {}
        self._send_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    @classmethod
    async def connect(cls, address: str, session_id: bytes, session_key: bytes, *,
                      timeout: float, metrics: SidecarMetrics | None = None,
                      window: int = DEFAULT_WINDOW,
                      socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
                      ssl: SSLContext | None = None) -> TcpPeerDataClient:
        """Connect to ``tcp://host:port`` (``tls://`` with ``ssl``) and authenticate;
        TransportError on failure, and when the address and ``ssl`` disagree."""
        scheme, rest = parse_address(address)
        check_tls_policy(address, scheme, ssl)
        host, port = split_host_port(rest)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, _, _, _, sockaddr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                stream: DataStream | None = None
                try:
                    tune_socket(sock, socket_buffer_bytes)
                    await loop.sock_connect(sock, sockaddr)
                    if ssl is None:
                        stream = SocketStream(sock)
                    else:
                        stream = await open_tls(sock, ssl, server_side=False, server_hostname=host,
                                                timeout=deadline - loop.time())
                    nonce = await cls._authenticate(stream, session_id, session_key, address)
                    extra = await cls._after_auth(stream, session_key, nonce, metrics)
                except BaseException:
                    if stream is not None:
                        stream.abort()
                    sock.close()
                    raise
        except TimeoutError:
            raise TransportError(f"connecting to {address} missed its {timeout:.3g}s deadline") from None
        except ssl_module.SSLCertVerificationError as exc:
            raise TransportError(f"TLS with {address} failed: the peer's certificate is not signed by this "
                                 f"pod's --tls-ca-file ({exc.verify_message}); every pool member needs a "
                                 "certificate of the same pool CA") from exc
        except ssl_module.SSLError as exc:
            hint = "; the peer does not speak TLS there" if exc.reason == "WRONG_VERSION_NUMBER" else ""
            raise TransportError(f"TLS with {address} failed: {exc}{hint}") from exc
        except (OSError, proto.ProtocolError) as exc:
            raise TransportError(f"connecting to {address} failed: {exc}") from exc
        client = cls(stream, metrics, window)
        client._opened(extra)
        client._reader = asyncio.create_task(client._read_loop(), name="tcp-data-reader")
        return client

    @classmethod
    async def _after_auth(cls, stream: DataStream, session_key: bytes, nonce: bytes,
                          metrics: SidecarMetrics | None) -> object:
        """More of the opening after AUTH_OK (a transport built on this client, data.nixl,
        reads the holder's metadata here); its result goes to ``_opened``."""
        return None

    def _opened(self, extra: object) -> None:
        """The client exists; ``extra`` is what ``_after_auth`` returned."""

    def _on_frame(self, header: proto.Header, payload: bytearray) -> bool:
        """A server frame plain TCP does not know; True when a subclass handled it."""
        return False

    @staticmethod
    async def _authenticate(stream: DataStream, session_id: bytes, session_key: bytes, address: str) -> bytes:
        header_buf = bytearray(proto.HEADER_BYTES)
        small = proto.MAX_UNAUTHENTICATED_PAYLOAD  # nor does this side read more before AUTH_OK
        try:
            header, payload = await read_frame(stream, header_buf, max_payload=small)
        except ConnectionError as exc:
            if stream.sock is not None:
                raise
            # asyncio closes a refused TLS connection without sending the alert: this is all we see.
            raise TransportError(
                f"TLS with {address} failed: the peer closed the connection before its session "
                "challenge, so it most likely refused this pod's certificate: --tls-cert-file must be "
                "signed by the CA the peer trusts (--tls-ca-file) and be valid now") from exc
        _raise_if_error(header, payload)
        if header.type is not proto.MessageType.AUTH_CHALLENGE or payload is None:
            raise proto.ProtocolError("malformed", f"expected AUTH_CHALLENGE, got {header.type.name}")
        nonce = proto.decode_auth_challenge(payload)
        await stream.send(proto.encode_auth_response(session_id, auth_proof(session_key, nonce)))
        header, payload = await read_frame(stream, header_buf, max_payload=small)
        _raise_if_error(header, payload)
        if header.type is not proto.MessageType.AUTH_OK or payload is None:
            raise proto.ProtocolError("malformed", f"expected AUTH_OK, got {header.type.name}")
        proto.decode_auth_ok(payload)
        return nonce

    def _rids(self, n: int) -> int:
        first = self._next_rid
        self._next_rid = (self._next_rid + n) % proto.REQUEST_ID_MOD
        return first

    async def _send(self, frame: list) -> None:
        async with self._send_lock:
            await self._stream.send(frame)

    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        """Number of leading ``keys`` the peer holds (one LOOKUP round trip)."""
        self._check_open()
        keys = list(keys)
        if not keys:
            return 0
        rid = self._rids(1)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._lookups[rid] = (fut, len(keys))
        try:
            async with asyncio.timeout(timeout):
                await self._send(proto.encode_lookup(rid, keys))
                sock = self._stream.sock  # None under TLS: the socket holds ciphertext
                if sock is not None and len(self._lookups) == 1 and not self._chunks:
                    poll_readable(sock, min(LOOKUP_SPIN_SECONDS, timeout))
                    count = self._take_lookup_reply(sock, rid, len(keys))
                    if count is not None:
                        return count
                return await fut
        except TimeoutError:
            exc = TransportError(f"lookup of {len(keys)} keys missed its {timeout:.3g}s deadline")
            self._fail(exc)
            raise exc from None
        except (OSError, proto.ProtocolError) as exc:
            self._fail(exc)
            raise TransportError(f"lookup failed: {exc}") from exc
        finally:
            self._lookups.pop(rid, None)

    def _take_lookup_reply(self, sock: socket.socket, rid: int, asked: int) -> int | None:
        """With nothing else in flight, take this lookup's reply straight off the socket
        when it is already there whole (peeked first: anything else, or a partial frame,
        is left to the reader task). Saves the reader task's hops on the hot path."""
        n = proto.HEADER_BYTES + 4
        try:
            head = sock.recv(n, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return None
        if len(head) < n:
            return None
        try:
            header = proto.decode_header(head[:proto.HEADER_BYTES])
        except proto.ProtocolError:
            return None  # the reader task reports it
        if (header.type is not proto.MessageType.LOOKUP_REPLY or header.request_id != rid
                or header.length != 4):
            return None
        data = sock.recv(n)  # the n bytes peeked above; nobody else reads meanwhile
        return proto.decode_lookup_reply(data[proto.HEADER_BYTES:], asked)

    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                    count: asyncio.Future[int] | None = None, first: int = 1) -> int:
        """Receive chunks straight into ``store`` slots; leading keys now visible."""
        self._check_open()
        return await run_fetch(keys, store, timeout, window=self._window,
                               send_requests=self._request_chunks, fail=self._fail,
                               metrics=self._metrics, count=count, first=first)

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        self._check_open()
        rid = self._rids(len(batch))
        for j, (_, p) in enumerate(batch):
            self._chunks[(rid + j) % proto.REQUEST_ID_MOD] = p
        await self._send(proto.encode_fetch(rid, [p.key for _, p in batch]))

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
        """Close the connection and fail every request in flight (idempotent)."""
        if self._error is None:
            self._error = exc
        err = exc if isinstance(exc, TransportError) else TransportError(f"data connection failed: {exc}")
        for p in self._chunks.values():
            if not p.done.done():
                p.done.set_exception(err)
        self._chunks.clear()
        for fut, _ in self._lookups.values():
            if not fut.done():
                fut.set_exception(err)
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task() and not reader.done():
            reader.cancel()  # its finally closes the socket; no byte lands in a slot after this
        elif reader is None or reader.done():
            self._stream.close()

    async def _read_loop(self) -> None:
        stream = self._stream
        header_buf = bytearray(proto.HEADER_BYTES)
        prefix_buf = bytearray(2 + proto.MAX_KEY_BYTES + 8)
        try:
            while True:
                await stream.recv_into(header_buf)
                header = proto.decode_header(header_buf)
                mtype = header.type
                if mtype is proto.MessageType.CHUNK:
                    await self._read_chunk(header, prefix_buf)
                    continue
                payload = bytearray(header.length)
                await stream.recv_into(payload)
                if mtype is proto.MessageType.LOOKUP_REPLY:
                    answer_lookup(self._lookups, header.request_id, payload)
                elif mtype is proto.MessageType.CHUNK_MISSING:
                    key = proto.decode_chunk_missing(payload)
                    p = self._chunks.pop(header.request_id, None)
                    if p is None or p.key != key:
                        raise proto.ProtocolError("bad_key", "CHUNK_MISSING for a key not requested")
                    p.reservation.abort()
                    if not p.done.done():
                        p.done.set_result(False)
                elif not self._on_frame(header, payload):
                    _raise_if_error(header, payload)
                    raise proto.ProtocolError("malformed", f"a server may not send {mtype.name} here")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not isinstance(exc, (TransportError, ConnectionError)):
                log.warning("TCP data client: closing the connection: %s", clip(exc))
            if isinstance(exc, proto.ProtocolError):
                count_protocol_error(self._metrics, exc.reason)
            self._fail(exc if isinstance(exc, TransportError) else TransportError(str(exc)))
        finally:
            stream.close()

    async def _read_chunk(self, header: proto.Header, prefix_buf: bytearray) -> None:
        stream = self._stream
        with memoryview(prefix_buf) as pv:
            await stream.recv_into(pv[:2])
            size = proto.chunk_prefix_bytes_needed(pv[:2])
            await stream.recv_into(pv[2:size])
            prefix = proto.decode_chunk_prefix(pv[:size])
        p = self._chunks.get(header.request_id)
        if p is None or p.key != prefix.key:
            raise proto.ProtocolError("bad_key", f"CHUNK {prefix.key.hex()} was not requested "
                                      f"under request id {header.request_id}")
        proto.check_chunk_payload(header.length, prefix.size, p.nbytes)
        await stream.recv_into(p.reservation.view, batch_bytes=RECV_BATCH_BYTES)
        del self._chunks[header.request_id]
        commit_received(p, prefix.checksum, self._metrics)


def _raise_if_error(header: proto.Header, payload: bytearray | None) -> None:
    if header.type is proto.MessageType.ERROR:
        raise TransportError(f"peer refused: {proto.decode_error(payload or b'')}")
    if header.type is proto.MessageType.CLOSE:
        raise TransportError("peer closed the data connection")
