"""The TCP data-plane server: authenticates a connection, then answers lookups and
fetches from pinned slots, replies written in order by one writer task per connection.

With an ``ssl`` context every accepted connection first completes a mutual TLS handshake
(a failed one is counted as ``unauthenticated`` and closed; the server keeps serving)
and the server advertises ``tls://host:port``.

Until a connection has proved its session it is held to the limits of ``data.before_auth``: a
place among ``MAX_UNAUTHENTICATED_PER_SOURCE`` per address and
``MAX_UNAUTHENTICATED_CONNECTIONS`` in all (else refused at accept), the TLS handshake and
the proof within ``auth_timeout`` together, and frames of at most
``proto.MAX_UNAUTHENTICATED_PAYLOAD`` bytes. Authenticated connections follow
``serving.ProvenConnections``: at most ``connections_per_session`` per session, ended when their
session ends (a retired key) or after ``SILENT_CLOSE_SECONDS`` without a frame; every socket
carries the kernel's keepalive and ``TCP_USER_TIMEOUT`` (``keepalive``).

After AUTH_OK a plain connection's LOOKUPs are answered on a thread of its own, without the
event loop, until its first other frame (``lookup_thread``): a fetcher's control connection
stays there, a lane moves to the loop's reader and writer at its first FETCH. The store's
``lookup_prefix`` must therefore be thread-safe (``ChunkStore``'s is).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import Authorize, StoreLike
from kv_offload_sidecar.data.before_auth import Place, spread
from kv_offload_sidecar.data.serving import SessionServer, check_auth, describe, end_tasks, make_nonce, wait_until_idle
from kv_offload_sidecar.data.tcp.lookup_thread import Frame, LookupThread
from kv_offload_sidecar.data.tcp.sockets import (
    SOCKET_BUFFER_BYTES,
    DataStream,
    SocketStream,
    read_frame,
    tune_socket,
)
from kv_offload_sidecar.data.tcp.tls_stream import open_tls

if TYPE_CHECKING:
    from ssl import SSLContext

    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)


# Request frames a server connection queues for its writer before it stops reading.
SERVER_QUEUE_FRAMES = 64


# Seconds without a request or reply after which a stopping server closes a connection.
IDLE_CLOSE_SECONDS = 0.25


# Bound of each goodbye step of a stopping server (sending CLOSE; draining until the client closes).
GOODBYE_DRAIN_SECONDS = 0.25


# Chunks one sendmsg call carries (each is three buffers; IOV_MAX is 1024).
SEND_GROUP = 16


# Seconds the ERROR frame before a refused connection's close may take to leave.
ERROR_SEND_SECONDS = 1.0


# Seconds asyncio's TLS handshake limit is set past the connection's deadline (so a slow
# handshake ends as a "timeout", by the deadline, not as a failed handshake).
TLS_TIMEOUT_MARGIN = 1.0


# Seconds between tries when accept() fails (e.g. the process is out of descriptors).
ACCEPT_RETRY_SECONDS = 0.05


class _ConnState:
    """What stop() needs to know about one server connection."""

    def __init__(self, queue: asyncio.Queue, source: str) -> None:
        # Replies waiting for the writer.
        self.queue = queue
        # The client's address, as refusals are logged.
        self.source = source
        # The session it proved (b"" before the proof).
        self.session_id = b""
        # Monotonic time of the last frame read (``ProvenConnections`` sweeps on it).
        self.heard = time.monotonic()
        # The task serving it.
        self.task = asyncio.current_task()
        # [True] while the writer sends an item.
        self.busy = [False]
        # Monotonic time of the last frame read or reply sent.
        self.last = time.monotonic()
        # Set by stop(): the connection ends with a goodbye (CLOSE, SHUT_WR, drain).
        self.closing = False
        # What a subclass keeps per connection (``_on_authenticated``); None for plain TCP.
        self.extra: Any = None

    def idle(self, now: float) -> bool:
        return self.queue.empty() and not self.busy[0] and now - self.last >= IDLE_CLOSE_SECONDS


class TcpDataPlaneServer(SessionServer):
    """Serves chunks from ``store`` to authenticated peers over TCP (TLS with ``ssl``)."""

    def __init__(self, store: StoreLike, authorize: Authorize, metrics: SidecarMetrics | None, *,
                 host: str = "127.0.0.1", port: int = 0, chunk_bytes: int, advertise_host: str | None = None,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, ssl: SSLContext | None = None,
                 **session: Any) -> None:
        """``session``: ``SessionServer``'s bounds (timeouts, connections per session, rejections)."""
        super().__init__(store, authorize, metrics, chunk_bytes=chunk_bytes, logger=log, **session)
        self._host = host
        self._port = port
        self._advertise_host = advertise_host
        self._buffer_bytes = socket_buffer_bytes
        self._ssl = ssl
        self._listener: socket.socket | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._states: dict[int, _ConnState] = {}

    @property
    def authenticated_connections(self) -> int:
        """Authenticated data connections open now, all sessions together."""
        return len(self._proven)

    async def start(self) -> str:
        """Bind and listen; returns ``tcp://host:port`` (``tls://`` with TLS), the port actually bound."""
        infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(sockaddr)
            lsock.listen(socket.SOMAXCONN)  # a siege's burst of connects is queued, not dropped
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
        scheme = "tls" if self._ssl is not None else "tcp"
        self.address = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        self._start_loops(self._accept_loop(), "tcp")
        return self.address

    def _log_source(self, source: str) -> str:
        """How a source address appears in rejection lines (which port it came to, too)."""
        return f"{source} (data port)"

    def _end_proven(self, conn: _ConnState) -> None:
        conn.closing = True  # a goodbye: CLOSE unless a chunk is half sent
        if conn.task is not None:
            conn.task.cancel()

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop accepting at once; keep serving open connections (a fetch in flight keeps
        asking for chunks) until each has been idle ``IDLE_CLOSE_SECONDS`` or
        ``grace_seconds`` pass, then close them cleanly: a CLOSE frame (when no chunk
        is half sent), ``shutdown(SHUT_WR)``, up to ``GOODBYE_DRAIN_SECONDS`` reading
        until the client closes too, then ``close``."""
        await self._stop_loops()
        if self._listener is not None:
            self._listener.close()
        await wait_until_idle(self._conns, self._states, grace_seconds)
        # Whatever is still open says goodbye: CLOSE (unless a chunk is half sent), SHUT_WR,
        # a brief drain of what the client still sends, then close (no reset).
        for st in self._states.values():
            st.closing = True
        await end_tasks(self._conns)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of descriptors: one summarised line, not one per try
                self._rejections.reject("accept", "accept failed", exc)
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            source = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
            place = self._limit.admit(source)
            if isinstance(place, str):
                self._refuse_at_accept(conn, source, place)
                continue
            try:
                tune_socket(conn, self._buffer_bytes)
            except OSError:  # the client already went away
                self._limit.leave(place, proved=False)
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn, place), name="tcp-data-conn")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)
            place.evict = lambda why, task=task, source=source: self._evict(task, source, why)

    def _refuse_at_accept(self, conn: socket.socket, source: str, why: str) -> None:
        """Over an unauthenticated-connection limit: counted, an ERROR frame when plain (one
        non-blocking send into an empty socket buffer), closed; nothing else is kept."""
        self._refuse(source, "too_many_connections", why)
        with contextlib.suppress(OSError):
            if self._ssl is None:
                conn.setblocking(False)
                conn.send(proto.join(proto.encode_error(0, "too_many_connections", why)))
        conn.close()

    async def _serve(self, conn: socket.socket, place: Place) -> None:
        source = place.source
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spread(self._auth_timeout)  # every step up to AUTH_OK together
        admitted = True  # holds a place in self._limit until authenticated or ended
        stream: DataStream | None = None
        header_buf = bytearray(proto.HEADER_BYTES)
        queue: asyncio.Queue[tuple[int, list[bytes]] | list] = asyncio.Queue(SERVER_QUEUE_FRAMES)
        state = self._states[id(conn)] = _ConnState(queue, source)
        writer: asyncio.Task[None] | None = None
        step = "TLS handshake"
        try:
            async with asyncio.timeout_at(deadline):
                if self._ssl is None:
                    stream = SocketStream(conn)
                else:
                    # asyncio's own handshake limit a little later: the deadline above ends it.
                    stream = await open_tls(conn, self._ssl, server_side=True,
                                            timeout=deadline - loop.time() + TLS_TIMEOUT_MARGIN)
                step = "session proof"
                nonce = make_nonce()
                await stream.send(proto.encode_auth_challenge(nonce))
                # A tiny frame limit until the proof: a header announcing more is refused
                # before its payload is read or a buffer for it allocated.
                header, payload = await read_frame(stream, header_buf, None,
                                                   max_payload=proto.MAX_UNAUTHENTICATED_PAYLOAD)
                if header.type is not proto.MessageType.AUTH_RESPONSE or payload is None:
                    raise proto.ProtocolError(
                        "unauthenticated", f"{header.type.name} before authentication; "
                        "answer the nonce with AUTH_RESPONSE first")
                answer = proto.decode_auth_response(payload)
                check_auth(self._authorize, nonce, answer)
                state.session_id = answer.session_id
                self._proven.admit(state)  # refused past connections_per_session
                await stream.send(proto.encode_auth_ok())
                state.extra = await self._on_authenticated(stream, answer.session_id, nonce)
            admitted = False
            self._limit.leave(place, proved=True)
            busy = state.busy
            writer = asyncio.create_task(self._write_loop(stream, id(conn), queue, busy),
                                         name="tcp-data-writer")
            # Plain: LOOKUPs answered on the connection's thread until its first other frame.
            first = None if stream.sock is None else await self._lookups_on_thread(stream.sock, state)
            while True:
                if first is None:
                    header, payload = await read_frame(stream, header_buf, self._chunk_bytes,
                                                       payload_timeout=self._auth_timeout)
                else:
                    (header, payload), first = first, None
                state.last = state.heard = time.monotonic()
                mtype = header.type
                if mtype is proto.MessageType.LOOKUP and payload is not None:
                    keys = proto.decode_keys(payload)
                    reply = proto.encode_lookup_reply(header.request_id, self._store.lookup_prefix(keys, touch=False))
                    if queue.empty() and not busy[0]:  # writer idle: answer without its hop
                        reply = stream.send_now(reply)
                    if reply:
                        await queue.put(reply)  # behind the chunks being sent
                elif mtype is proto.MessageType.FETCH and payload is not None:
                    await queue.put((header.request_id, proto.decode_keys(payload)))
                elif mtype is proto.MessageType.CLOSE:
                    break
                elif payload is None or not await self._on_frame(state, header, payload):
                    raise proto.ProtocolError("malformed", f"a client may not send {mtype.name}")
                if writer.done():
                    break
            if writer is not None and not writer.done():
                await queue.join()
        except proto.ProtocolError as exc:
            self._refuse(source, exc.reason, exc.message)
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(BaseException):
                    await writer
            if stream is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(ERROR_SEND_SECONDS):
                        await stream.send(proto.encode_error(0, exc.reason, exc.message))
        except TimeoutError:
            if admitted:  # the deadline of the steps before AUTH_OK
                self._refuse(source, "timeout", f"no session proved within {self._auth_timeout:.3g}s (at the {step})")
            else:
                log.debug("TCP data plane: connection ended: a step missed its time limit")
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError) as exc:  # ssl.SSLError is an OSError
            if admitted and self._ssl is not None and stream is None:
                # A TLS handshake that failed: a client without a certificate of the pool's CA?
                self._refuse(source, "unauthenticated",
                             "TLS handshake failed (a client without a certificate of the pool's CA?): "
                             f"{str(exc) or type(exc).__name__}")
            else:
                log.debug("TCP data plane: connection ended: %s", exc)
        except Exception as exc:  # a bug reached by some input: counted and summarised, no traceback
            self._refuse(source, "malformed", f"unexpected {describe(exc)}")
            log.debug("TCP data plane: unexpected error", exc_info=True)
        finally:
            if admitted:
                self._limit.leave(place, proved=False)
            self._proven.leave(state)
            self._states.pop(id(conn), None)
            half_sent = state.busy[0]
            if writer is not None and not writer.done():
                writer.cancel()
                with contextlib.suppress(BaseException):
                    await writer
            if stream is None:
                conn.close()
            else:
                if state.closing:  # stop(): CLOSE (unless a chunk is half sent), wait for the client
                    with contextlib.suppress(BaseException):
                        await stream.goodbye(send_close=not half_sent, seconds=GOODBYE_DRAIN_SECONDS)
                stream.close()
            if state.extra is not None:
                await self._on_closed(state)

    async def _lookups_on_thread(self, sock: socket.socket, state: _ConnState) -> Frame | None:
        """Answer the connection's LOOKUPs on a thread (``lookup_thread``) until its first
        other frame, which is returned (None: no thread, the loop serves them all)."""

        def heard() -> None:
            state.last = state.heard = time.monotonic()

        lookup = LookupThread(sock, lambda keys: self._store.lookup_prefix(keys, touch=False), heard,
                              chunk_bytes=self._chunk_bytes, payload_timeout=self._auth_timeout,
                              send_timeout=self._send_timeout)
        return await lookup.run()

    # ---- what a transport built on this server (data.nixl) adds -------------------------

    async def _on_authenticated(self, stream: DataStream, session_id: bytes, nonce: bytes) -> Any:
        """The connection proved ``session_id`` (AUTH_OK is sent); returns what the subclass
        keeps per connection in ``_ConnState.extra`` (None: nothing)."""
        return None

    async def _on_frame(self, state: _ConnState, header: proto.Header, payload: bytearray) -> bool:
        """A client frame plain TCP does not know; True when the subclass handled it."""
        return False

    async def _on_closed(self, state: _ConnState) -> None:
        """The connection of ``state`` (whose ``extra`` is set) ended; must not raise."""

    async def _write_loop(self, stream: DataStream, conn_id: int, queue: asyncio.Queue,
                          busy: list[bool]) -> None:
        try:
            while True:
                item = await queue.get()
                busy[0] = True
                try:
                    if isinstance(item, list):
                        await stream.send(item)
                    else:
                        await self._send_chunks(stream, *item, self._states.get(conn_id))
                finally:
                    busy[0] = False
                    queue.task_done()
                    state = self._states.get(conn_id)
                    if state is not None:
                        state.last = time.monotonic()
        except (ConnectionError, OSError, TimeoutError) as exc:
            log.info("TCP data plane: dropping a client that stopped reading: %s", exc)
            stream.abort()  # ends the reader too
            while not queue.empty():
                queue.get_nowait()
                queue.task_done()

    async def _send_chunks(self, stream: DataStream, request_id: int, keys: list[bytes],
                           state: _ConnState | None = None) -> None:
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
                    await stream.send(buffers)
            finally:
                buffers.clear()
                for pin in pins:
                    pin.release()
            if self._metrics is not None and pins:
                self._metrics.peer_bytes.labels(direction="sent").inc(self._chunk_bytes * len(pins))
