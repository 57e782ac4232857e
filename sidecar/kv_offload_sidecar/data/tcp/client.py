"""The TCP data-plane client: lookups and windowed fetches to one peer, chunk bytes
received straight into reserved store slots and committed only once their checksum matches.

Contract: a chunk received on the connection's own thread (``stream_worker``) is committed
there, and the chunks behind it on the connection are read, received and committed there too
while more are due, so the lanes of a striped fetch never queue on the event loop for their
per-chunk steps; the loop resolves each chunk's future (in batches, ``LoopWakes``) and sends
the requests. A commit holds the worker's lock and none starts once the worker is stopped: when
``_fail`` returns, no commit is under way, none comes, and what is not committed may be
aborted. Rows are taken and finished there under each ``Landing``'s lock (``row_landings``).

A ``tls://`` address takes an ``ssl`` client context (mutual TLS, then the same session
HMAC inside); a pod with a context refuses ``tcp://`` peers, so a TLS pool never sends KV
in the clear.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.address import check_tls_policy, parse_address
from kv_offload_sidecar.data.base import ReceiveStopped, TransportError, auth_proof, count_protocol_error
from kv_offload_sidecar.data.fetch import (
    DEFAULT_WINDOW,
    PendingChunk,
    answer_lookup,
    commit_outcome,
    commit_received,
)
from kv_offload_sidecar.data.peer_client import (
    FramedPeerDataClient,
    challenge_nonce,
    check_auth_ok,
    raise_if_refused,
)
from kv_offload_sidecar.data.tcp.sockets import (
    SOCKET_BUFFER_BYTES,
    DataStream,
    SocketStream,
    poll_readable,
    read_frame,
    readable_poller,
    split_host_port,
    tune_socket,
)
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES, LoopWakes, StreamStopped, StreamWorker, loop_wakes
from kv_offload_sidecar.data.tcp.tls_stream import open_tls
from kv_offload_sidecar.rejections import clip
from kv_offload_sidecar.store.checksum import chunk_hasher

if TYPE_CHECKING:
    import select
    from ssl import SSLContext

    import xxhash

    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)


# Chunk bytes the client lets arrive before the loop wakes up to take them (SO_RCVLOWAT).
# Well under half of any receive buffer the kernel grows to, so the wake-up always comes.
RECV_BATCH_BYTES = 2 << 20

# Most bytes one receive takes before they are hashed: still in the last-level cache, and
# few enough wake-ups that a 512 MiB fetch spends its time in the copy, not in the loop
# (4 MiB with 2 MiB batches: 0.13 s per 512 MiB against 0.16-0.18 s with 1 MiB / 512 KiB,
# sender and receiver on one core, measured side by side).
RECV_PIECE_BYTES = 4 << 20


# What ``_land_on_thread`` returns when it committed every chunk due and read nothing after.
LANDED_ON_THREAD = object()

# Seconds a lookup with nothing else in flight polls for its reply before sleeping.
LOOKUP_SPIN_SECONDS = 200e-6

# A LOOKUP_REPLY frame whole: its header and its u32 count.
_REPLY = struct.Struct(proto.HEADER.format + "I")
_LOOKUP_REPLY = int(proto.MessageType.LOOKUP_REPLY)


class TcpPeerDataClient(FramedPeerDataClient):
    """An authenticated TCP connection to one peer's data plane."""

    _send_errors = (OSError, proto.ProtocolError)
    receives_into_offered_rows = True

    def __init__(self, stream: DataStream, metrics: SidecarMetrics | None, window: int) -> None:
        super().__init__(metrics, window)
        self._stream = stream
        self._chunks: dict[int, PendingChunk] = {}
        self._send_lock = asyncio.Lock()
        # The socket's poller of the lookup's spin (``_spin``; made at the first).
        self._poller: select.poll | None = None

    @classmethod
    async def connect(cls, address: str, session_id: bytes, session_key: bytes, *,
                      timeout: float, metrics: SidecarMetrics | None = None,
                      window: int = DEFAULT_WINDOW,
                      socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
                      ssl: SSLContext | None = None,
                      reached: Callable[[], None] | None = None) -> TcpPeerDataClient:
        """Connect to ``tcp://host:port`` (``tls://`` with ``ssl``) and authenticate;
        TransportError on failure, and when the address and ``ssl`` disagree. ``reached()``
        is called once the TCP connection is made, before TLS and the proof."""
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
                    if reached is not None:
                        reached()
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
                        stream.close()
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
        nonce = challenge_nonce(header, payload)
        await stream.send(proto.encode_auth_response(session_id, auth_proof(session_key, nonce)))
        check_auth_ok(*await read_frame(stream, header_buf, max_payload=small))
        return nonce

    def _rids(self, n: int) -> int:
        first = self._next_rid
        self._next_rid = (self._next_rid + n) % proto.REQUEST_ID_MOD
        return first

    async def _send(self, frame: list) -> None:
        async with self._send_lock:
            await self._stream.send(frame)

    def _lookup_reply_now(self, rid: int, asked: int, timeout: float) -> int | None:
        sock = self._stream.sock  # None under TLS: the socket holds ciphertext
        if sock is None or len(self._lookups) != 1 or self._chunks:
            return None
        self._spin(min(LOOKUP_SPIN_SECONDS, timeout))
        return self._take_lookup_reply(sock, rid, asked)

    def _spin(self, seconds: float) -> None:
        """``poll_readable`` with this connection's poller (made at the first lookup)."""
        if self._poller is None:
            self._poller = readable_poller(self._stream.sock)  # type: ignore[arg-type]
        poll_readable(self._poller, seconds)

    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        """The framed client's lookup; with nothing else in flight on a plain connection, its
        LOOKUP is written straight to the socket and its reply taken straight off it (no
        future, timer, lock or reader task on the way: about half of an idle lookup's time
        went there), else, or when either is not whole at once, the framed path."""
        sock = self._stream.sock  # None under TLS
        if (sock is None or self._lookups or self._chunks or self._send_lock.locked() or not keys
                or self._error is not None):
            return await super().lookup(keys, timeout)
        rid = self._rids(1)
        asked = len(keys)
        try:
            frame = proto.lookup_frame(rid, keys)
            sent = sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except self._send_errors as exc:
            self._fail(exc)
            raise TransportError(f"lookup failed: {exc}") from exc
        if sent == len(frame):
            self._spin(min(LOOKUP_SPIN_SECONDS, timeout))
            count = self._take_lookup_reply(sock, rid, asked)
            if count is not None:
                return count
        # Not answered at once: the reader task answers it. Registered before any await, so
        # a reply the reader takes meanwhile finds its future.
        async with self._answered(asked, "lookup", f"lookup of {asked} keys missed its {timeout:.3g}s deadline",
                                  rid) as (_, fut):
            async with asyncio.timeout(timeout):
                if sent < len(frame):
                    await self._send([frame[sent:]])
                return await fut

    def _take_lookup_reply(self, sock: socket.socket, rid: int, asked: int) -> int | None:
        """With nothing else in flight, take this lookup's reply straight off the socket
        when it is already there whole (peeked first: anything else, or a partial frame,
        is left to the reader task). Saves the reader task's hops on the hot path."""
        try:
            head = sock.recv(_REPLY.size, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return None
        if len(head) < _REPLY.size:
            return None
        magic, major, mtype, got_rid, length, count = _REPLY.unpack(head)
        if (magic, major, mtype, got_rid, length) != (proto.MAGIC, proto.WIRE_MAJOR, _LOOKUP_REPLY, rid, 4):
            return None  # another frame, or a broken one: the reader task takes (or reports) it
        sock.recv(_REPLY.size)  # the bytes peeked above; nobody else reads meanwhile
        if count > asked:
            raise proto.ProtocolError("malformed", f"LOOKUP_REPLY claims {count} hits for {asked} keys")
        return count

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        self._check_open()
        rid = self._rids(len(batch))
        for j, (_, p) in enumerate(batch):
            self._chunks[(rid + j) % proto.REQUEST_ID_MOD] = p
        await self._send(proto.encode_fetch(rid, [p.key for _, p in batch]))

    def _stop_receiving(self) -> None:
        """The load job that offered a chunk's row ended mid-chunk: end the connection now
        (the connection's thread has stopped writing into the row when this returns)."""
        self._fail(ReceiveStopped("a load job ended while its chunk was arriving in its row"))

    def _fail(self, exc: BaseException) -> None:
        # First stop the connection's thread: a chunk it is receiving into a slot or an
        # offered row gets no byte more once this returns (the slot may be aborted and
        # reused, the row handed back to vLLM).
        self._stream.abort()
        super()._fail(exc)
        reader = self._reader
        if reader is None or reader.done():
            self._stream.close()  # else the reader's finally closes it, once cancelled

    async def _read_loop(self) -> None:
        stream = self._stream
        header_buf = bytearray(proto.HEADER_BYTES)
        prefix_buf = bytearray(2 + proto.MAX_KEY_BYTES + 8)
        # The next frame's header (and a CHUNK's prefix size) when the connection's thread
        # read them right after the chunk before (``_read_ahead``).
        ahead: tuple[proto.Header, int] | None = None
        try:
            while True:
                if ahead is None:
                    await stream.recv_into(header_buf)
                    self.heard_at = time.monotonic()
                    header, prefix_size = proto.decode_header(header_buf), 0
                else:
                    (header, prefix_size), ahead = ahead, None
                mtype = header.type
                if mtype is proto.MessageType.CHUNK:
                    ahead = await self._read_chunk(header, prefix_buf, prefix_size, header_buf)
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
                    raise_if_refused(header, payload)
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

    async def _read_chunk(self, header: proto.Header, prefix_buf: bytearray, prefix_size: int,
                          header_buf: bytearray) -> tuple[proto.Header, int] | None:
        """One CHUNK's prefix (unless read ahead: ``prefix_size``) and payload, committed; the
        next frame's header when the connection's thread read it right after (``_read_ahead``).
        A chunk received on the connection's thread is committed there, and the chunks right
        behind it received and committed there too (``_land_on_thread``): the loop only
        resolves their futures."""
        stream = self._stream
        with memoryview(prefix_buf) as pv:
            if not prefix_size:
                await stream.recv_into(pv[:2])
                prefix_size = proto.chunk_prefix_bytes_needed(pv[:2])
                await stream.recv_into(pv[2:prefix_size])
            prefix = proto.decode_chunk_prefix(pv[:prefix_size])
        p = self._requested(header, prefix)
        view = p.reservation.receive_view(self._stop_receiving, p.gate)
        # Each piece hashed as it lands, from the cache (for a chunk: on the connection's
        # thread, or on its hashing thread while the next piece arrives where a second core
        # is usable, ``stream_worker.spare_core``): no second pass over the slot from memory.
        # Only this reader writes the reserved slot, so the digest of the pieces is the slot's.
        # Every receive into the slot or row holds the chunk's gate: none starts past the
        # fetch's (or the row's job's) deadline, even while this loop is late (``write_gates``).
        hasher = chunk_hasher()
        wakes = loop_wakes(asyncio.get_running_loop())

        def land(worker: StreamWorker) -> object:
            return self._land_on_thread(worker, wakes, header.request_id, p, prefix.checksum, hasher,
                                        header_buf, prefix_buf)

        ahead = await stream.recv_into(view, batch_bytes=RECV_BATCH_BYTES, on_piece=self._on_piece(hasher),
                                       piece_bytes=RECV_PIECE_BYTES, gate=p.gate, then=land)
        if ahead is None:  # received on the loop (a small chunk): committed here
            del self._chunks[header.request_id]
            commit_received(p, prefix.checksum, self._metrics, hasher.intdigest())
            return None
        if ahead is LANDED_ON_THREAD:
            return None
        if isinstance(ahead, BaseException):
            raise ahead  # the chunks before it are in: the connection ends after them
        return ahead  # type: ignore[return-value]

    def _requested(self, header: proto.Header, prefix: proto.ChunkPrefix) -> PendingChunk:
        """The pending chunk a CHUNK frame answers (ProtocolError when it was not asked for)."""
        p = self._chunks.get(header.request_id)
        if p is None or p.key != prefix.key:
            raise proto.ProtocolError("bad_key", f"CHUNK {prefix.key.hex()} was not requested "
                                      f"under request id {header.request_id}")
        proto.check_chunk_payload(header.length, prefix.size, p.nbytes)
        return p

    def _on_piece(self, hasher: xxhash.xxh3_64) -> Callable[[memoryview], None]:
        update = hasher.update

        def on_piece(piece: memoryview) -> None:
            update(piece)
            self.heard_at = time.monotonic()  # bytes still coming: the holder is alive
        return on_piece

    def _land_on_thread(self, worker: StreamWorker, wakes: LoopWakes, rid: int, p: PendingChunk,
                        checksum: int, hasher: xxhash.xxh3_64, header_buf: bytearray,
                        prefix_buf: bytearray) -> object:
        """(On the connection's thread, right after a chunk's payload.) Commit it here, then,
        while more chunks are due on this connection, read the next frame and, for a CHUNK,
        receive and commit it here too, and so on: each chunk's future gets its outcome
        through the loop's ``LoopWakes`` (one wake-up for all that finish before the loop
        runs). Every commit holds the worker's ``lock`` and none starts once it is stopped, so
        when ``_fail`` (``stream.abort``) returns, no commit is under way and none comes: the
        fetch may abort what is left. Returns what the loop goes on with: the next frame's
        header and prefix size (a frame that is no CHUNK, or a chunk small enough for the loop),
        ``LANDED_ON_THREAD`` when nothing more is due, or the error that ends the connection."""
        try:
            while True:
                with worker.lock:
                    if worker.stopped:
                        raise StreamStopped("the connection was stopped before its chunk's commit")
                    if self._chunks.get(rid) is p:
                        del self._chunks[rid]
                    error = commit_outcome(p, checksum, self._metrics, hasher.intdigest())
                wakes.post(p.done, True, error)  # type: ignore[arg-type]
                ahead = self._read_ahead(worker, header_buf, prefix_buf)
                if ahead is None:
                    return LANDED_ON_THREAD
                if isinstance(ahead, BaseException) or ahead[0].type is not proto.MessageType.CHUNK:
                    return ahead
                header, size = ahead
                prefix = proto.decode_chunk_prefix(memoryview(prefix_buf)[:size])
                p = self._requested(header, prefix)
                if p.nbytes < OFF_LOOP_BYTES:
                    return ahead  # the loop receives it
                rid, checksum, hasher = header.request_id, prefix.checksum, chunk_hasher()
                view = p.reservation.receive_view(self._stop_receiving, p.gate)
                worker.receive(view, RECV_PIECE_BYTES, RECV_BATCH_BYTES, self._on_piece(hasher), p.gate)
        except Exception as exc:  # noqa: BLE001 (handed to the loop, which ends the connection)
            return exc

    def _read_ahead(self, worker: StreamWorker, header_buf: bytearray,
                    prefix_buf: bytearray) -> tuple[proto.Header, int] | BaseException | None:
        """(On the connection's thread, right after a chunk's commit.) While more chunks are
        due on this connection, the next frame's header, and a CHUNK's prefix, read here: the
        loop then makes none of those small receives (each a GIL hand-over that convoys with
        the lanes' threads, and an epoll registration when the frame is not there yet). The
        reader task awaits this thread meanwhile, so nothing else reads the socket; a stop
        (``_fail``) wakes it. Returns (header, prefix bytes; 0 for a frame that is no CHUNK),
        None when nothing more is due, or the error (raised on the loop)."""
        if not self._chunks:  # every chunk requested is in (dict length: atomic)
            return None
        try:
            with memoryview(header_buf) as hv:
                worker.receive(hv, len(hv), 0, None)
            self.heard_at = time.monotonic()
            header = proto.decode_header(header_buf)
            if header.type is not proto.MessageType.CHUNK:
                return header, 0
            with memoryview(prefix_buf) as pv:
                worker.receive(pv[:2], 2, 0, None)
                size = proto.chunk_prefix_bytes_needed(pv[:2])
                worker.receive(pv[2:size], size - 2, 0, None)
            return header, size
        except Exception as exc:  # noqa: BLE001 (handed to the loop, which ends the connection)
            return exc
