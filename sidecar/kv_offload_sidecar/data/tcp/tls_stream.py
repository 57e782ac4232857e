"""A TCP data connection under TLS: the standard library's ``ssl`` on an asyncio transport.

The plain path's zero-copy tricks (``sendmsg`` of the pinned slot, ``sock_recv_into``,
``SO_RCVLOWAT``, ``MSG_PEEK``, polling the socket) work on the socket, which under TLS
carries ciphertext, so none of them is used here. ``TlsStream`` keeps the
``sockets.SocketStream`` contract on top of asyncio's SSL transport instead, as a
buffered protocol: a read of at least ``DIRECT_READ_BYTES`` (a chunk's bytes) is
decrypted by OpenSSL straight into the caller's buffer, the reserved store slot;
smaller reads (headers, control payloads) are served from a staging buffer. A
``StreamReader`` would copy every chunk three more times.

Writes go through ``transport.write``, which encrypts them before it returns, so a
pinned slot may be released once ``send`` returns; ``send`` writes a chunk in
``WRITE_PIECE_BYTES`` pieces and waits on the transport's flow control between them,
so little more than the socket buffer's worth of ciphertext is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Sequence

from kv_offload_sidecar.data import protocol as proto

# Decrypted bytes held for reads not yet made (headers and small payloads).
STAGING_BYTES = 256 << 10
# Reads of at least this many bytes are decrypted straight into the caller's buffer.
DIRECT_READ_BYTES = 64 << 10
# Free staging space below which the transport stops reading until the reader catches up.
MIN_FREE_BYTES = 32 << 10
# Buffers smaller than this are joined into one write (one TLS record instead of several).
JOIN_BELOW_BYTES = 64 << 10
# Larger buffers are written in pieces of this size, so the SSL layer's memory BIO and the
# transport's buffer hold one piece of ciphertext, not a whole chunk (a 16 MiB chunk written
# at once cost the sender 2.6x the CPU-seconds per GB).
WRITE_PIECE_BYTES = 256 << 10
# Seconds the TLS closing handshake (close_notify) may take after close().
SHUTDOWN_SECONDS = 1.0


async def open_tls(sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                   timeout: float, server_hostname: str | None = None) -> TlsStream:
    """Run the TLS handshake on a connected socket; ``ssl.SSLError``/``OSError``/``TimeoutError``
    when it fails (the socket is closed then)."""
    loop = asyncio.get_running_loop()
    timeout = max(timeout, 1e-3)
    if server_side:
        _, stream = await loop.connect_accepted_socket(
            TlsStream, sock, ssl=context, ssl_handshake_timeout=timeout,
            ssl_shutdown_timeout=SHUTDOWN_SECONDS)
    else:
        _, stream = await loop.create_connection(
            TlsStream, sock=sock, ssl=context, server_hostname=server_hostname or "",
            ssl_handshake_timeout=timeout, ssl_shutdown_timeout=SHUTDOWN_SECONDS)
    return stream


class TlsStream(asyncio.BufferedProtocol):
    """One TLS data connection (``sockets.DataStream``)."""

    # No cleartext socket: peeking or polling it would see ciphertext.
    sock: socket.socket | None = None

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        # Allocated at the first decrypted byte: a connection still in its handshake (a
        # stranger without a certificate of the pool's CA never leaves it) holds none.
        self._staging = bytearray()
        self._staged = memoryview(self._staging)
        self._start = 0  # unread staged bytes are _staging[_start:_end]
        self._end = 0
        # The caller's buffer a direct read fills, and how much of it is filled.
        self._direct: memoryview | None = None
        self._direct_got = 0
        # True while the buffer handed out by get_buffer is _direct (not staging).
        self._handed_direct = False
        # Staged bytes a waiting small read needs.
        self._want = 0
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._eof = False
        # Why the connection ended (set once it did).
        self._lost: BaseException | None = None

    # ---- asyncio protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None and self._waiter is not None and not self._waiter.done():
            self._handed_direct = True
            return self._direct[self._direct_got:]
        self._handed_direct = False
        if not self._staging:
            self._staging = bytearray(STAGING_BYTES)
            self._staged = memoryview(self._staging)
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._staging) - self._end < MIN_FREE_BYTES:
            n = self._end - self._start  # move the unread bytes to the front
            self._staged[:n] = bytes(self._staged[self._start:self._end])
            self._start, self._end = 0, n
        return self._staged[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._handed_direct:
            self._direct_got += nbytes
            if self._direct is not None and self._direct_got >= len(self._direct):
                self._wake()
            return
        self._end += nbytes
        if self._end - self._start >= self._want:
            self._wake()
        if (len(self._staging) - (self._end - self._start) < MIN_FREE_BYTES
                and not self._reading_paused and self._transport is not None):
            self._reading_paused = True  # the reader is behind: let TCP push back
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("TLS connection closed")
        self._wake()
        self._resume_writers()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._resume_writers()

    # ---- the stream

    async def recv_into(self, view: memoryview | bytearray, *, batch_bytes: int = 0) -> None:
        """Fill ``view`` completely; ConnectionError when the connection ends first.
        (``batch_bytes`` is a plain-socket knob; TLS records already batch.)"""
        with memoryview(view) as mv:
            n = len(mv)
            got = self._take(mv)
            if n - got >= DIRECT_READ_BYTES:
                with mv[got:] as rest:
                    self._direct, self._direct_got = rest, 0
                    try:
                        while self._direct_got < len(rest):
                            await self._wait(f"after {got + self._direct_got} of {n} bytes")
                    finally:
                        self._direct = None
                return
            while got < n:
                self._want = n - got
                try:
                    await self._wait(f"after {got} of {n} bytes")
                finally:
                    self._want = 0
                with mv[got:] as rest:
                    got += self._take(rest)

    def _take(self, mv: memoryview) -> int:
        """Copy staged bytes into ``mv``; how many."""
        k = min(len(mv), self._end - self._start)
        if k:
            mv[:k] = self._staged[self._start:self._start + k]
            self._start += k
        if self._reading_paused and len(self._staging) - (self._end - self._start) >= len(self._staging) // 2:
            self._reading_paused = False
            if self._transport is not None and not self._transport.is_closing():
                self._transport.resume_reading()
        return k

    async def _wait(self, where: str) -> None:
        if self._lost is not None or self._eof:
            raise self._ended(where)
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False  # everything staged was taken: read again
            self._transport.resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if (self._lost is not None or self._eof) and self._end == self._start and (
                self._direct is None or self._direct_got < len(self._direct)):
            raise self._ended(where)

    def _ended(self, where: str) -> ConnectionError:
        if self._lost is not None and not isinstance(self._lost, ConnectionError):
            return ConnectionError(f"TLS connection lost {where}: {self._lost}")
        return ConnectionError(f"connection closed {where}")

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def send(self, buffers: Sequence) -> None:
        small = bytearray()  # small buffers, joined and written with the next piece
        for b in buffers:
            if len(b) < JOIN_BELOW_BYTES:
                small += b
                continue
            mv = memoryview(b)
            for at in range(0, len(mv), WRITE_PIECE_BYTES):
                piece = mv[at:at + WRITE_PIECE_BYTES]
                self._write([small, piece] if small else [piece])
                small = bytearray()
                await self._drain()
        if small:
            self._write([small])
            await self._drain()

    def send_now(self, frame: list) -> list:
        self._write([proto.join(frame)])  # buffered by the transport: never partial
        return []

    def _write(self, data: list) -> None:
        """Encrypt ``data`` (one socket write for all of it)."""
        if self._transport is None or self._lost is not None or self._transport.is_closing():
            raise ConnectionError(f"TLS connection is closed: {self._lost or 'closing'}")
        if self._eof:
            raise ConnectionError("the peer closed the TLS connection")
        self._transport.writelines(data)

    async def _drain(self) -> None:
        while self._writing_paused and self._lost is None:
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = self._loop.create_future()
            await asyncio.shield(self._drain_waiter)
        if self._lost is not None:
            raise ConnectionError(f"TLS connection lost while sending: {self._lost}")

    def _resume_writers(self) -> None:
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    async def goodbye(self, *, send_close: bool, seconds: float) -> None:
        """CLOSE (when ``send_close``), then read and discard until the client closes (it
        does on CLOSE) or ``seconds`` pass, then close with TLS's close_notify. (TLS over
        asyncio has no half-close, so no ``SHUT_WR`` step.)"""
        if send_close:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(seconds):
                    await self.send(proto.encode_close())
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(seconds):
                while True:
                    self._start = self._end = 0
                    await self._wait("while closing")
        self.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
