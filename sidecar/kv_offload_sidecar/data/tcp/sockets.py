"""Non-blocking socket primitives of the TCP data plane: exact receives into buffers,
scatter-gather sends, frame reads and the ``tcp://host:port`` address.

``SocketStream`` is a plain connection as the server and client use it; ``tls_stream.TlsStream``
has the same methods over TLS. Both: ``recv_into`` (fill a buffer exactly), ``send`` (buffers
in order), ``send_now`` (a small frame without awaiting), ``goodbye``, ``abort``, ``close``;
``sock`` is the socket only on a plain connection (its peek and poll tricks need cleartext).
Both move a chunk's bytes on the connection's own thread (``stream_worker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES, StreamWorker, drop_sent, send_some
from kv_offload_sidecar.data.write_gates import WriteGate
from kv_offload_sidecar.keepalive import keep_alive
from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES

log = logging.getLogger(__name__)


# Socket buffer size asked for on data connections; 0 leaves Linux's autotuning on,
# which grows the buffers past net.core.*mem_max (a fixed size would cap them there).
SOCKET_BUFFER_BYTES = 0


def tune_socket(sock: socket.socket, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Non-blocking, no Nagle delay, the kernel's liveness rule (``keepalive``); fixed buffer
    sizes only when asked."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_alive(sock)
    if buffer_bytes:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       view: memoryview | bytearray, *, batch_bytes: int = 0,
                       on_piece: Callable[[memoryview], object] | None = None,
                       piece_bytes: int = CACHED_PIECE_BYTES, gate: WriteGate | None = None) -> None:
    """Fill ``view`` completely from ``sock``; ConnectionError on EOF.

    ``batch_bytes``: for a large read, ask the kernel (SO_RCVLOWAT) to wake the loop
    only once that much has arrived, so a chunk costs a few event-loop wake-ups
    instead of one per segment burst. ``on_piece``: called with each piece received, in
    order, right after it landed (at most ``piece_bytes``: still in the cache). ``gate``:
    each receive into ``view`` is made under it (``write_gates``): a loop that resumes past
    the transfer's deadline writes nothing more (``LateWrite``).
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
                end = n if on_piece is None else min(n, got + piece_bytes)
                with mv[got:end] as rest:
                    if gate is None:
                        k = await loop.sock_recv_into(sock, rest)
                    else:
                        k = await _gated_recv_into(loop, sock, rest, gate)
                    if k and on_piece is not None:
                        with rest[:k] as piece:
                            on_piece(piece)
                if k == 0:
                    raise ConnectionError(f"connection closed after {got} of {n} bytes")
                got += k
        finally:
            if lowat != 1:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


async def _gated_recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview,
                           gate: WriteGate) -> int:
    """One ``recv_into`` of ``view`` under ``gate``, once ``sock`` is readable (``sock_recv_into``
    would make the call inside its readiness callback, past any check made before it)."""
    while True:
        with gate.writing(len(view)):
            try:
                return sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                pass
        fut = loop.create_future()
        fd = sock.fileno()
        loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(fd)


async def send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, buffers: Sequence) -> None:
    """Send ``buffers`` in order with ``sendmsg`` (gather, no concatenation)."""
    views = [memoryview(b) for b in buffers if len(b)]
    try:
        while views:
            drop_sent(views, send_some(sock, views))
            if views:
                await _writable(loop, sock)
    finally:
        for v in views:
            v.release()


def send_now(sock: socket.socket, frame: list) -> list:
    """Send a small frame right away (no writer hop); returns what the socket did not take."""
    data = proto.join(frame)
    try:
        sent = sock.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    return [data[sent:]] if sent < len(data) else []


def readable_poller(sock: socket.socket) -> select.poll:
    """A poller of ``sock``'s readiness to read (made once per connection, for ``poll_readable``)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
    return poller


def poll_readable(poller: select.poll, seconds: float) -> None:
    """Spin briefly until the socket of ``poller`` (``readable_poller``) has data: a reply due
    in microseconds is then read without the process going to sleep in epoll and paying the
    wake-up."""
    if poller.poll(0):
        return
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if poller.poll(0):
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


async def read_frame(stream: DataStream, header_buf: bytearray, chunk_bytes: int | None = None,
                     payload_timeout: float | None = None, *,
                     max_payload: int = proto.MAX_CONTROL_PAYLOAD) -> tuple[proto.Header, bytearray | None]:
    """Read one header and, unless it is a CHUNK, its (size-checked) payload.

    ``payload_timeout``: seconds the payload may take once its header arrived
    (a peer that stops mid-frame is refused as ``malformed``). ``max_payload``: the
    longest payload accepted (``proto.MAX_UNAUTHENTICATED_PAYLOAD`` before AUTH_OK); a
    longer one is refused at its header, before its buffer exists.
    """
    await stream.recv_into(header_buf)
    header = proto.decode_header(header_buf, chunk_bytes, max_payload=max_payload)
    if header.type is proto.MessageType.CHUNK:
        return header, None
    payload = bytearray(header.length)
    got = 0
    sock = stream.sock
    if sock is not None:  # plain: a payload mostly comes whole with its header
        try:
            got = sock.recv_into(payload)
            if got == 0 and header.length:
                raise ConnectionError(f"connection closed after 0 of {header.length} bytes")
        except (BlockingIOError, InterruptedError):
            pass
        if got == header.length:
            return header, payload  # no timer armed and cancelled, no loop turn
    try:
        async with asyncio.timeout(payload_timeout):
            with memoryview(payload) as mv, mv[got:] as rest:
                await stream.recv_into(rest)
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


class DataStream(Protocol):
    """One data connection's bytes, plain (``SocketStream``) or TLS (``tls_stream.TlsStream``)."""

    # The socket when the connection is plain; None under TLS.
    sock: socket.socket | None

    async def recv_into(self, view: memoryview | bytearray, *, batch_bytes: int = 0,
                        on_piece: Callable[[memoryview], object] | None = None,
                        piece_bytes: int = CACHED_PIECE_BYTES, gate: WriteGate | None = None,
                        then: Callable[[StreamWorker], object] | None = None) -> object:
        """Fill ``view`` completely, ``on_piece`` called with each piece as it lands (see
        ``recv_exactly``); ConnectionError on EOF. ``gate``: every receive into ``view``, on
        the loop or on the connection's thread, is made under it (``write_gates``). ``then``:
        when ``view`` was filled on the connection's thread, called there right after with
        its worker (to read what follows without a loop turn); returns its result, else None."""

    async def send(self, buffers: Sequence) -> None:
        """Send ``buffers`` in order; once it returns, they may be reused or released."""

    def send_now(self, frame: list) -> list:
        """Send a small frame without awaiting; returns what is left for ``send``."""

    async def goodbye(self, *, send_close: bool, seconds: float) -> None:
        """End the connection without a reset: CLOSE (when ``send_close``), then wait up to
        ``seconds`` per step for the peer to close too."""

    def abort(self) -> None:
        """Stop both directions now (a reader blocked on this stream gets ConnectionError)."""

    def close(self) -> None:
        """Close; idempotent."""


class SocketStream:
    """A plain connection: the non-blocking socket, zero-copy both ways.

    Transfers of at least ``OFF_LOOP_BYTES`` (a chunk's payload, a group of chunks) run on
    the connection's own thread (``stream_worker.StreamWorker``) with the GIL released, so
    the event loop stays free and several connections use several cores; once such a call
    returns or raises, the thread no longer touches its buffers. ``abort`` and ``close``
    stop the thread first."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._worker = StreamWorker(sock, "kv-offload-tcp-stream")

    async def recv_into(self, view: memoryview | bytearray, *, batch_bytes: int = 0,
                        on_piece: Callable[[memoryview], object] | None = None,
                        piece_bytes: int = CACHED_PIECE_BYTES, gate: WriteGate | None = None,
                        then: Callable[[StreamWorker], object] | None = None) -> object:
        """``on_piece``, ``piece_bytes``, ``gate``: see ``recv_exactly``; ``then``: see ``DataStream``."""
        if len(view) >= OFF_LOOP_BYTES:
            worker = self._worker
            with memoryview(view) as mv:
                return await worker.run(lambda: worker.receive_then(
                    mv, piece_bytes if on_piece is not None else len(mv), batch_bytes, on_piece, gate, then))
        await recv_exactly(self._loop, self._sock, view, batch_bytes=batch_bytes,
                           on_piece=on_piece, piece_bytes=piece_bytes, gate=gate)
        return None

    async def send(self, buffers: Sequence) -> None:
        if sum(len(b) for b in buffers) >= OFF_LOOP_BYTES:
            await self._worker.run(lambda: self._worker.send(buffers))
            return
        await send_all(self._loop, self._sock, buffers)

    def send_now(self, frame: list) -> list:
        return send_now(self._sock, frame)

    async def goodbye(self, *, send_close: bool, seconds: float) -> None:
        """CLOSE (skipped when a chunk frame was cut short: the client then sees the
        stream end mid-frame, a failed fetch), ``SHUT_WR`` so the client reads EOF
        after it, then discard what the client still sends until it closes or
        ``seconds`` pass (closing with unread bytes would send RST)."""
        if send_close:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(seconds):
                    await self.send(proto.encode_close())
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(seconds):
                while await self._loop.sock_recv(self._sock, 65536):
                    pass

    def abort(self) -> None:
        """Stop both directions now; the connection's thread, if it is moving bytes, has
        stopped touching its buffers when this returns."""
        self._worker.stop()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._sock.fileno() != -1:
            self.abort()
        self._sock.close()
