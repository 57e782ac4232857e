"""A TCP data connection under TLS: the standard library's ``ssl`` on a non-blocking socket.

The plain path's zero-copy tricks (``sendmsg`` of the pinned slot, ``SO_RCVLOWAT``,
``MSG_PEEK``, polling the socket for a reply) work on the socket, which under TLS carries
ciphertext, so none of them is used here. ``TlsStream`` keeps the ``sockets.SocketStream``
contract on an ``ssl.SSLSocket`` instead: OpenSSL reads the ciphertext from the socket and
decrypts it straight into the caller's buffer (the reserved store slot), and encrypts
straight from the pinned slot; no staging copy either way.

As on a plain connection, transfers of at least ``OFF_LOOP_BYTES`` (a chunk) run on the
connection's own thread (``TlsWorker``, a ``stream_worker.StreamWorker``): OpenSSL releases
the GIL while it decrypts, encrypts and moves bytes, and the chunk's checksum is computed as
each piece lands (on that thread, or beside it where a second core is usable), so lanes under TLS spread over the cores
as plain ones do
and the event loop stays free. Smaller reads and writes (headers, control frames) run on the
loop, waiting for the socket with ``add_reader``/``add_writer``.

One OpenSSL connection must never be used by two threads at once: every call into it, from
the loop or from the thread, holds the worker's ``lock`` (one record's work at most, so the
loop waits microseconds when it meets the thread). A write OpenSSL could not finish
(``SSLWantWriteError``) is retried with the same bytes before any other write, as OpenSSL
requires, by the ``send`` that started it; so ``send_now`` writes nothing itself (a frame
it wrote into a full socket would bind the next write, whoever makes it) and hands the
frame to the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
from collections.abc import Callable, Sequence

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES, StreamWorker, drop_sent
from kv_offload_sidecar.data.write_gates import WriteGate
from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES

# Buffers smaller than this are joined into one write (one TLS record instead of several).
JOIN_BELOW_BYTES = 64 << 10
# Plaintext handed to OpenSSL per write call: a few records, so the lock is held briefly.
WRITE_PIECE_BYTES = 256 << 10
# Bytes read and dropped per call while draining a closing connection.
DRAIN_READ_BYTES = 64 << 10


async def open_tls(sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                   timeout: float, server_hostname: str | None = None) -> TlsStream:
    """Run the TLS handshake on a connected non-blocking socket (which the stream then owns);
    ``ssl.SSLError``/``OSError``/``TimeoutError`` when it fails (the socket is closed then)."""
    loop = asyncio.get_running_loop()
    tls = context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False,
                              server_hostname=None if server_side else (server_hostname or None))
    try:
        async with asyncio.timeout(max(timeout, 1e-3)):
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await _ready(loop, tls.fileno(), select.POLLIN)
                except ssl.SSLWantWriteError:
                    await _ready(loop, tls.fileno(), select.POLLOUT)
    except BaseException:
        tls.close()
        raise
    return TlsStream(tls)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, events: int,
                 waiters: set[asyncio.Future[None]] | None = None) -> None:
    """Until ``fd`` is readable (``POLLIN``) or writable, or a waker in ``waiters`` fires."""
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    add, remove = ((loop.add_reader, loop.remove_reader) if events & select.POLLIN
                   else (loop.add_writer, loop.remove_writer))
    add(fd, ready)
    if waiters is not None:
        waiters.add(fut)
    try:
        await fut
    finally:
        remove(fd)
        if waiters is not None:
            waiters.discard(fut)


def _ssl_call(call: Callable[[memoryview], int], view: memoryview) -> tuple[int, int]:
    """One OpenSSL read or write: (its result, 0), or (0, the poll events it must wait for);
    ConnectionError when the connection failed (a bad record, an alert from the peer)."""
    try:
        return call(view), 0
    except ssl.SSLWantReadError:
        return 0, select.POLLIN
    except ssl.SSLWantWriteError:
        return 0, select.POLLOUT
    except ssl.SSLError as exc:
        raise ConnectionError(f"TLS connection lost: {exc}") from exc


def _gated(gate: WriteGate, nbytes: int, call: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    """``call()`` (one read into a transfer's target) under ``gate``."""
    with gate.writing(nbytes):
        return call()


class TlsWorker(StreamWorker):
    """``StreamWorker`` whose socket calls go through OpenSSL."""

    def recv_some(self, view: memoryview) -> tuple[int, int]:
        return _ssl_call(self._sock.recv_into, view)  # 0 bytes at close_notify or at EOF

    def send_views(self, views: list[memoryview]) -> tuple[int, int]:
        # The same first piece until OpenSSL takes it: a retry after SSLWantWriteError must
        # pass the same bytes.
        with views[0][:WRITE_PIECE_BYTES] as piece:
            return _ssl_call(self._sock.send, piece)


def _joined(buffers: Sequence) -> list:
    """``buffers`` with each run of small ones joined (one record for a header and its
    payload, not one each)."""
    out: list = []
    small = bytearray()
    for b in buffers:
        if len(b) < JOIN_BELOW_BYTES:
            small += b
            continue
        if small:
            out.append(small)
            small = bytearray()
        out.append(b)
    if small:
        out.append(small)
    return out


class TlsStream:
    """One TLS data connection (``sockets.DataStream``)."""

    # No cleartext socket: peeking or polling it would see ciphertext.
    sock: socket.socket | None = None

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self._tls = tls
        self._loop = asyncio.get_running_loop()
        self._worker = TlsWorker(tls, "kv-offload-tls-stream")
        # Loop-side waits for the socket, woken by abort()/close() (a closed descriptor
        # would never report ready).
        self._waiters: set[asyncio.Future[None]] = set()

    async def _on_loop(self, call: Callable[[], tuple[int, int]]) -> int:
        """Run one OpenSSL call on the loop (under the worker's lock) until it needs no wait."""
        while True:
            if self._worker.stopped or self._tls.fileno() == -1:
                raise ConnectionError("TLS connection was stopped")
            with self._worker.lock:
                done, wait = call()
            if not wait:
                return done
            await _ready(self._loop, self._tls.fileno(), wait, self._waiters)

    async def recv_into(self, view: memoryview | bytearray, *, batch_bytes: int = 0,
                        on_piece: Callable[[memoryview], object] | None = None,
                        piece_bytes: int = CACHED_PIECE_BYTES, gate: WriteGate | None = None,
                        then: Callable[[StreamWorker], object] | None = None) -> object:
        """Fill ``view`` completely; ConnectionError when the connection ends first.
        ``on_piece``: called with each piece as it lands (``sockets.recv_exactly``);
        ``batch_bytes`` is a plain-socket knob (TLS records already batch). ``gate``: each
        decrypting read into ``view`` is made under it (``write_gates``). ``then``: see
        ``sockets.DataStream``."""
        with memoryview(view) as mv:
            n = len(mv)
            if n >= OFF_LOOP_BYTES:
                worker = self._worker
                return await worker.run(lambda: worker.receive_then(
                    mv, piece_bytes if on_piece is not None else n, 0, on_piece, gate, then))
            got = 0
            while got < n:
                with mv[got:] as rest:
                    k = await self._on_loop(lambda: self._worker.recv_some(rest) if gate is None
                                            else _gated(gate, len(rest), lambda: self._worker.recv_some(rest)))
                if k == 0:
                    raise ConnectionError(f"connection closed after {got} of {n} bytes")
                if on_piece is not None:
                    with mv[got:got + k] as piece:
                        on_piece(piece)
                got += k
        return None

    async def send(self, buffers: Sequence) -> None:
        buffers = _joined(buffers)
        if sum(len(b) for b in buffers) >= OFF_LOOP_BYTES:
            await self._worker.run(lambda: self._worker.send(buffers))
            return
        views = [memoryview(b) for b in buffers if len(b)]
        try:
            while views:
                drop_sent(views, await self._on_loop(lambda: self._worker.send_views(views)))
        finally:
            for v in views:
                v.release()

    def send_now(self, frame: list) -> list:
        """The whole frame, joined, for ``send`` (see the module docstring)."""
        return [proto.join(frame)]

    async def goodbye(self, *, send_close: bool, seconds: float) -> None:
        """CLOSE (when ``send_close``), then read and discard until the client closes (it
        does on CLOSE) or ``seconds`` pass, then close with TLS's close_notify."""
        if send_close:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(seconds):
                    await self.send(proto.encode_close())
        scratch = bytearray(DRAIN_READ_BYTES)
        with contextlib.suppress(OSError, TimeoutError), memoryview(scratch) as mv:
            async with asyncio.timeout(seconds):
                while await self._on_loop(lambda: self._worker.recv_some(mv)):
                    pass
        self.close()

    def abort(self) -> None:
        """Stop both directions now; the connection's thread, if it is moving bytes, has
        stopped touching its buffers when this returns, and loop-side waits wake."""
        self._worker.stop()
        self._wake()

    def close(self) -> None:
        if self._tls.fileno() == -1:
            return
        if not self._worker.stopped:
            self._worker.stop(shutdown=False)  # no OpenSSL call under way or to come
            with contextlib.suppress(OSError, ValueError):
                self._tls.unwrap()  # close_notify, best effort (the socket is non-blocking)
        with contextlib.suppress(OSError):  # the plain shutdown: wakes a thread still polling
            socket.socket.shutdown(self._tls, socket.SHUT_RDWR)
        self._wake()
        self._tls.close()

    def _wake(self) -> None:
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(None)
