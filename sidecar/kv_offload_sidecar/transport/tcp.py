"""The plain TCP data plane: asyncio over non-blocking sockets, zero-copy both ways.

Server: one task per connection reads request frames; one writer task per
connection sends replies in order with ``sendmsg([header, prefix, slot view])``
(the pinned slot is passed to the kernel as is, never copied in Python).
Client: one reader task per connection receives every reply; chunk bytes go with
``loop.sock_recv_into`` straight into the reserved slot, then are committed with
the sender's checksum. Several chunks are requested ahead (the fetch window) so
the socket never idles between chunks. TCP_NODELAY; socket buffers autotuned by the kernel.

Address: ``tcp://host:port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import protocol as proto
from .base import (
    DEFAULT_AUTH_TIMEOUT,
    DEFAULT_SEND_TIMEOUT,
    DEFAULT_WINDOW,
    Authorize,
    DataPlaneServer,
    PeerDataClient,
    PendingChunk,
    StoreLike,
    TransportError,
    answer_lookup,
    auth_proof,
    check_auth,
    commit_received,
    count_protocol_error,
    make_nonce,
    run_fetch,
    wait_until_idle,
)

if TYPE_CHECKING:
    from ..metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Socket buffer size asked for on data connections; 0 leaves Linux's autotuning on,
# which grows the buffers past net.core.*mem_max (a fixed size would cap them there).
SOCKET_BUFFER_BYTES = 0
# Request frames a server connection queues for its writer before it stops reading.
SERVER_QUEUE_FRAMES = 64
# Seconds without a request or reply after which a stopping server closes a connection.
IDLE_CLOSE_SECONDS = 0.25
# Bound of each goodbye step of a stopping server (sending CLOSE; draining until the client closes).
GOODBYE_DRAIN_SECONDS = 0.25
# Chunk bytes the client lets arrive before the loop wakes up to take them (SO_RCVLOWAT).
RECV_BATCH_BYTES = 512 << 10
# Chunks one sendmsg call carries (each is three buffers; IOV_MAX is 1024).
SEND_GROUP = 16
# Seconds a lookup with nothing else in flight polls for its reply before sleeping.
LOOKUP_SPIN_SECONDS = 200e-6


def tune_socket(sock: socket.socket, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Non-blocking, no Nagle delay; fixed buffer sizes only when asked."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       view: memoryview | bytearray, *, batch_bytes: int = 0) -> None:
    """Fill ``view`` completely from ``sock``; ConnectionError on EOF.

    ``batch_bytes``: for a large read, ask the kernel (SO_RCVLOWAT) to wake the loop
    only once that much has arrived, so a chunk costs a few event-loop wake-ups
    instead of one per segment burst.
    """
    with memoryview(view) as mv:
        got, n = 0, len(mv)
        lowat = 1
        try:
            while got < n:
                if batch_bytes:
                    want = max(1, min(n - got, batch_bytes))
                    if want != lowat:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                        lowat = want
                with mv[got:] as rest:
                    k = await loop.sock_recv_into(sock, rest)
                if k == 0:
                    raise ConnectionError(f"connection closed after {got} of {n} bytes")
                got += k
        finally:
            if lowat != 1:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


async def send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, buffers: Sequence) -> None:
    """Send ``buffers`` in order with ``sendmsg`` (gather, no concatenation)."""
    views = [memoryview(b) for b in buffers if len(b)]
    try:
        while views:
            try:
                sent = sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                sent = 0
            while sent and views:
                first = views[0]
                if sent >= len(first):
                    sent -= len(first)
                    views.pop(0).release()
                else:
                    views[0] = first[sent:]
                    first.release()
                    sent = 0
            if views:
                await _writable(loop, sock)
    finally:
        for v in views:
            v.release()


def _send_now(sock: socket.socket, frame: list) -> list:
    """Send a small frame right away (no writer hop); returns what the socket did not take."""
    data = proto.join(frame)
    try:
        sent = sock.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    return [data[sent:]] if sent < len(data) else []


def _poll_readable(sock: socket.socket, seconds: float) -> None:
    """Spin briefly until ``sock`` has data: a reply due in microseconds is then read
    without the process going to sleep in epoll and paying the wake-up."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if select.select([sock], [], [], 0)[0]:
            return


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, header_buf: bytearray,
                     chunk_bytes: int | None = None,
                     payload_timeout: float | None = None) -> tuple[proto.Header, bytearray | None]:
    """Read one header and, unless it is a CHUNK, its (size-checked) payload.

    ``payload_timeout``: seconds the payload may take once its header arrived
    (a peer that stops mid-frame is refused as ``malformed``).
    """
    await recv_exactly(loop, sock, header_buf)
    header = proto.decode_header(header_buf, chunk_bytes)
    if header.type is proto.MessageType.CHUNK:
        return header, None
    payload = bytearray(header.length)
    try:
        async with asyncio.timeout(payload_timeout):
            await recv_exactly(loop, sock, payload)
    except TimeoutError:
        raise proto.ProtocolError("malformed", f"{header.type.name} frame stalled: its "
                                  f"{header.length}-byte payload did not arrive within "
                                  f"{payload_timeout:.3g}s") from None
    return header, payload


def split_host_port(rest: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"TCP data address {rest!r} is not host:port")
    return host.strip("[]"), int(port)


class _ConnState:
    """What stop() needs to know about one server connection."""

    def __init__(self, queue: asyncio.Queue) -> None:
        # Replies waiting for the writer.
        self.queue = queue
        # [True] while the writer sends an item.
        self.busy = [False]
        # Monotonic time of the last frame read or reply sent.
        self.last = time.monotonic()
        # Set by stop(): the connection ends with a goodbye (CLOSE, SHUT_WR, drain).
        self.closing = False

    def idle(self, now: float) -> bool:
        return self.queue.empty() and not self.busy[0] and now - self.last >= IDLE_CLOSE_SECONDS


async def _goodbye(loop: asyncio.AbstractEventLoop, conn: socket.socket, *, send_close: bool) -> None:
    """End a connection a stopping server still holds, without a reset.

    CLOSE (skipped when a chunk frame was cut short: the client then sees the
    stream end mid-frame, a failed fetch), ``SHUT_WR`` so the client reads EOF
    after it, then discard what the client still sends until it closes or
    ``GOODBYE_DRAIN_SECONDS`` pass (closing with unread bytes would send RST).
    """
    if send_close:
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(GOODBYE_DRAIN_SECONDS):
                await send_all(loop, conn, proto.encode_close())
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(GOODBYE_DRAIN_SECONDS):
            while await loop.sock_recv(conn, 65536):
                pass


class TcpDataPlaneServer(DataPlaneServer):
    """Serves chunks from ``store`` to authenticated peers over TCP."""

    def __init__(
        self,
        store: StoreLike,
        authorize: Authorize,
        metrics: SidecarMetrics | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int,
        advertise_host: str | None = None,
        auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
    ) -> None:
        if chunk_bytes != store.slot_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} differs from the store's slot_bytes="
                             f"{store.slot_bytes}; pass the pool's kv_bytes_per_chunk to both")
        self._store = store
        self._authorize = authorize
        self._metrics = metrics
        self._host = host
        self._port = port
        self._chunk_bytes = chunk_bytes
        self._advertise_host = advertise_host
        self._auth_timeout = auth_timeout
        self._send_timeout = send_timeout
        self._buffer_bytes = socket_buffer_bytes
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._states: dict[int, _ConnState] = {}
        self._stopping = False
        self.address = ""

    async def start(self) -> str:
        """Bind and listen; returns ``tcp://host:port`` with the port actually bound."""
        infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(sockaddr)
            lsock.listen(128)
            lsock.setblocking(False)
        except OSError as exc:
            lsock.close()
            raise OSError(exc.errno, f"cannot listen on {self._host}:{self._port} for the TCP "
                          f"data plane ({exc.strerror}); pick another --data-port") from exc
        self._listener = lsock
        port = lsock.getsockname()[1]
        host = self._advertise_host or self._host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        self.address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._accept_task = asyncio.create_task(self._accept_loop(), name="tcp-data-accept")
        return self.address

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop accepting at once; keep serving open connections (a fetch in flight keeps
        asking for chunks) until each has been idle ``IDLE_CLOSE_SECONDS`` or
        ``grace_seconds`` pass, then close them cleanly: a CLOSE frame (when no chunk
        is half sent), ``shutdown(SHUT_WR)``, up to ``GOODBYE_DRAIN_SECONDS`` reading
        until the client closes too, then ``close``."""
        self._stopping = True
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        await wait_until_idle(self._conns, self._states, grace_seconds)
        # Whatever is still open says goodbye: CLOSE (unless a chunk is half sent), SHUT_WR,
        # a brief drain of what the client still sends, then close (no reset).
        for st in self._states.values():
            st.closing = True
        still = list(self._conns)
        for t in still:
            t.cancel()
        if still:
            await asyncio.wait(still)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                log.warning("TCP data plane: accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            tune_socket(conn, self._buffer_bytes)
            task = asyncio.create_task(self._serve(conn), name="tcp-data-conn")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        header_buf = bytearray(proto.HEADER_BYTES)
        queue: asyncio.Queue[tuple[int, list[bytes]] | list] = asyncio.Queue(SERVER_QUEUE_FRAMES)
        state = self._states[id(conn)] = _ConnState(queue)
        writer: asyncio.Task[None] | None = None
        try:
            nonce = make_nonce()
            async with asyncio.timeout(self._auth_timeout):
                await send_all(loop, conn, proto.encode_auth_challenge(nonce))
                header, payload = await read_frame(loop, conn, header_buf, self._chunk_bytes)
                if header.type is not proto.MessageType.AUTH_RESPONSE or payload is None:
                    raise proto.ProtocolError(
                        "unauthenticated", f"{header.type.name} before authentication; "
                        "answer the nonce with AUTH_RESPONSE first")
                check_auth(self._authorize, nonce, proto.decode_auth_response(payload))
                await send_all(loop, conn, proto.encode_auth_ok())
            busy = state.busy
            writer = asyncio.create_task(self._write_loop(conn, queue, busy), name="tcp-data-writer")
            while True:
                header, payload = await read_frame(loop, conn, header_buf, self._chunk_bytes,
                                                   payload_timeout=self._auth_timeout)
                state.last = time.monotonic()
                mtype = header.type
                if mtype is proto.MessageType.LOOKUP and payload is not None:
                    keys = proto.decode_keys(payload)
                    reply = proto.encode_lookup_reply(header.request_id, self._store.lookup_prefix(keys))
                    if queue.empty() and not busy[0]:  # writer idle: answer without its hop
                        reply = _send_now(conn, reply)
                    if reply:
                        await queue.put(reply)  # behind the chunks being sent
                elif mtype is proto.MessageType.FETCH and payload is not None:
                    await queue.put((header.request_id, proto.decode_keys(payload)))
                elif mtype is proto.MessageType.CLOSE:
                    break
                else:
                    raise proto.ProtocolError("malformed", f"a client may not send {mtype.name}")
                if writer.done():
                    break
            if writer is not None and not writer.done():
                await queue.join()
        except proto.ProtocolError as exc:
            count_protocol_error(self._metrics, exc.reason)
            log.warning("TCP data plane: closing a connection: %s", exc)
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(BaseException):
                    await writer
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await send_all(loop, conn, proto.encode_error(0, exc.reason, exc.message))
        except TimeoutError:
            count_protocol_error(self._metrics, "unauthenticated")
            log.warning("TCP data plane: a connection did not authenticate within %.3gs",
                        self._auth_timeout)
        except (ConnectionError, OSError) as exc:
            log.debug("TCP data plane: connection ended: %s", exc)
        finally:
            self._states.pop(id(conn), None)
            half_sent = state.busy[0]
            if writer is not None and not writer.done():
                writer.cancel()
                with contextlib.suppress(BaseException):
                    await writer
            if state.closing:
                with contextlib.suppress(BaseException):
                    await _goodbye(loop, conn, send_close=not half_sent)
            else:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    async def _write_loop(self, conn: socket.socket, queue: asyncio.Queue, busy: list[bool]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                item = await queue.get()
                busy[0] = True
                try:
                    if isinstance(item, list):
                        await send_all(loop, conn, item)
                    else:
                        await self._send_chunks(loop, conn, *item)
                finally:
                    busy[0] = False
                    queue.task_done()
                    state = self._states.get(id(conn))
                    if state is not None:
                        state.last = time.monotonic()
        except (ConnectionError, OSError, TimeoutError) as exc:
            log.info("TCP data plane: dropping a client that stopped reading: %s", exc)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # ends the reader too
            while not queue.empty():
                queue.get_nowait()
                queue.task_done()

    async def _send_chunks(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                           request_id: int, keys: list[bytes]) -> None:
        """Answer a FETCH: CHUNK (header, prefix, pinned slot view) or CHUNK_MISSING per key,
        up to ``SEND_GROUP`` chunks per ``sendmsg`` so the kernel sees one long gather list."""
        for start in range(0, len(keys), SEND_GROUP):
            pins = []
            buffers: list = []
            try:
                for i, key in enumerate(keys[start:start + SEND_GROUP], start):
                    rid = (request_id + i) % proto.REQUEST_ID_MOD
                    pin = self._store.pin(key)
                    if pin is None:
                        buffers += proto.encode_chunk_missing(rid, key)
                    else:
                        pins.append(pin)
                        buffers += proto.encode_chunk(rid, key, pin.checksum, pin.view)
                async with asyncio.timeout(self._send_timeout * max(1, len(pins))):
                    await send_all(loop, conn, buffers)
            finally:
                buffers.clear()
                for pin in pins:
                    pin.release()
            if self._metrics is not None and pins:
                self._metrics.peer_bytes.labels(direction="sent").inc(self._chunk_bytes * len(pins))


class TcpPeerDataClient(PeerDataClient):
    """An authenticated TCP connection to one peer's data plane."""

    def __init__(self, sock: socket.socket, metrics: SidecarMetrics | None, window: int) -> None:
        self._sock = sock
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
                      socket_buffer_bytes: int = SOCKET_BUFFER_BYTES) -> TcpPeerDataClient:
        """Connect to ``tcp://host:port`` and authenticate; TransportError on failure."""
        rest = address.removeprefix("tcp://")
        host, port = split_host_port(rest)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, _, _, _, sockaddr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    tune_socket(sock, socket_buffer_bytes)
                    await loop.sock_connect(sock, sockaddr)
                    await cls._authenticate(loop, sock, session_id, session_key)
                except BaseException:
                    sock.close()
                    raise
        except TimeoutError:
            raise TransportError(f"connecting to {address} missed its {timeout:.3g}s deadline") from None
        except (OSError, proto.ProtocolError) as exc:
            raise TransportError(f"connecting to {address} failed: {exc}") from exc
        client = cls(sock, metrics, window)
        client._reader = asyncio.create_task(client._read_loop(), name="tcp-data-reader")
        return client

    @staticmethod
    async def _authenticate(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                            session_id: bytes, session_key: bytes) -> None:
        header_buf = bytearray(proto.HEADER_BYTES)
        header, payload = await read_frame(loop, sock, header_buf)
        _raise_if_error(header, payload)
        if header.type is not proto.MessageType.AUTH_CHALLENGE or payload is None:
            raise proto.ProtocolError("malformed", f"expected AUTH_CHALLENGE, got {header.type.name}")
        nonce = proto.decode_auth_challenge(payload)
        await send_all(loop, sock, proto.encode_auth_response(session_id, auth_proof(session_key, nonce)))
        header, payload = await read_frame(loop, sock, header_buf)
        _raise_if_error(header, payload)
        if header.type is not proto.MessageType.AUTH_OK or payload is None:
            raise proto.ProtocolError("malformed", f"expected AUTH_OK, got {header.type.name}")
        proto.decode_auth_ok(payload)

    def _rids(self, n: int) -> int:
        first = self._next_rid
        self._next_rid = (self._next_rid + n) % proto.REQUEST_ID_MOD
        return first

    async def _send(self, frame: list) -> None:
        async with self._send_lock:
            await send_all(asyncio.get_running_loop(), self._sock, frame)

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
                if len(self._lookups) == 1 and not self._chunks:
                    _poll_readable(self._sock, min(LOOKUP_SPIN_SECONDS, timeout))
                    count = self._take_lookup_reply(rid, len(keys))
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

    def _take_lookup_reply(self, rid: int, asked: int) -> int | None:
        """With nothing else in flight, take this lookup's reply straight off the socket
        when it is already there whole (peeked first: anything else, or a partial frame,
        is left to the reader task). Saves the reader task's hops on the hot path."""
        n = proto.HEADER_BYTES + 4
        try:
            head = self._sock.recv(n, socket.MSG_PEEK)
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
        data = self._sock.recv(n)  # the n bytes peeked above; nobody else reads meanwhile
        return proto.decode_lookup_reply(data[proto.HEADER_BYTES:], asked)

    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float) -> int:
        """Receive chunks straight into ``store`` slots; leading keys now visible."""
        self._check_open()
        return await run_fetch(keys, store, timeout, window=self._window,
                               send_requests=self._request_chunks, fail=self._fail,
                               metrics=self._metrics)

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        self._check_open()
        rid = self._rids(len(batch))
        for j, (_, p) in enumerate(batch):
            self._chunks[(rid + j) % proto.REQUEST_ID_MOD] = p
        await self._send(proto.encode_fetch(rid, [p.key for _, p in batch]))

    async def close(self) -> None:
        """Send CLOSE (best effort) and close the socket."""
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
            self._sock.close()

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sock = self._sock
        header_buf = bytearray(proto.HEADER_BYTES)
        prefix_buf = bytearray(2 + proto.MAX_KEY_BYTES + 8)
        try:
            while True:
                await recv_exactly(loop, sock, header_buf)
                header = proto.decode_header(header_buf)
                mtype = header.type
                if mtype is proto.MessageType.CHUNK:
                    await self._read_chunk(loop, header, prefix_buf)
                    continue
                payload = bytearray(header.length)
                await recv_exactly(loop, sock, payload)
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
                else:
                    _raise_if_error(header, payload)
                    raise proto.ProtocolError("malformed", f"a server may not send {mtype.name} here")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not isinstance(exc, (TransportError, ConnectionError)):
                log.warning("TCP data client: closing the connection: %s", exc)
            if isinstance(exc, proto.ProtocolError):
                count_protocol_error(self._metrics, exc.reason)
            self._fail(exc if isinstance(exc, TransportError) else TransportError(str(exc)))
        finally:
            sock.close()

    async def _read_chunk(self, loop: asyncio.AbstractEventLoop, header: proto.Header,
                          prefix_buf: bytearray) -> None:
        sock = self._sock
        with memoryview(prefix_buf) as pv:
            await recv_exactly(loop, sock, pv[:2])
            size = proto.chunk_prefix_bytes_needed(pv[:2])
            await recv_exactly(loop, sock, pv[2:size])
            prefix = proto.decode_chunk_prefix(pv[:size])
        p = self._chunks.get(header.request_id)
        if p is None or p.key != prefix.key:
            raise proto.ProtocolError("bad_key", f"CHUNK {prefix.key.hex()} was not requested "
                                      f"under request id {header.request_id}")
        proto.check_chunk_payload(header.length, prefix.size, p.nbytes)
        await recv_exactly(loop, sock, p.reservation.view, batch_bytes=RECV_BATCH_BYTES)
        del self._chunks[header.request_id]
        commit_received(p, prefix.checksum, self._metrics)


def _raise_if_error(header: proto.Header, payload: bytearray | None) -> None:
    if header.type is proto.MessageType.ERROR:
        raise TransportError(f"peer refused: {proto.decode_error(payload or b'')}")
    if header.type is proto.MessageType.CLOSE:
        raise TransportError("peer closed the data connection")
