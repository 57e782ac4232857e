"""A holder's connection that carries only LOOKUPs, answered on a thread of its own.

A laned fetcher (``data.lanes``) sends its LOOKUPs and heartbeats (empty LOOKUPs) on a control
connection that carries nothing else. Read on the event loop, each of them paid the loop's
machinery before a byte of it was looked at: an epoll registration added and removed, a future,
a task step, a loop turn; about half of the holder's share of an idle 32-key lookup. Here such a
connection's frames are read on a thread of its own, which sleeps in poll(2) with the GIL
released, and each LOOKUP is answered there: read, looked up in the store and its reply
written, the loop never woken.

Contract:
- Plain TCP only (the socket itself); a TLS connection keeps the loop's path.
- ``LookupThread.run`` serves the connection from AUTH_OK until the first frame that is no
  LOOKUP (a FETCH, CLOSE, a subclass's frame) and returns that frame; the loop's reader serves
  the connection from then on as before. So while the thread runs it is the connection's only
  reader and only writer (nothing is queued for the writer before a FETCH), and a connection
  that carries chunks never has two writers. It reads exactly one frame at a time (its
  header, then its payload), never past it.
- The loop's bounds hold: ``decode_header``'s ``max_payload``, a payload within
  ``payload_timeout`` of its header (else ``ProtocolError('malformed')``), each reply gone
  within ``send_timeout`` (else ``TimeoutError``); a client that stops reading its replies
  stops this thread reading its requests. Every error reaches the awaiting task, which refuses
  and closes as before.
- ``lookup`` (the store's ``lookup_prefix``) is called on the thread: it must be thread-safe
  (``ChunkStore``'s takes its lock).
- ``run`` cancelled (the connection swept or the server stopping) stops the thread
  (``stop``): once ``stop`` returns the thread makes no socket call more, so the task may read,
  write and close the socket.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.tcp.stream_worker import loop_wakes

_LOOKUP = int(proto.MessageType.LOOKUP)
_LOOKUP_REPLY = int(proto.MessageType.LOOKUP_REPLY)
# A LOOKUP_REPLY whole (``proto.encode_lookup_reply``'s bytes): its header and its u32 count.
_REPLY = struct.Struct(proto.HEADER.format + "I")
_REPLY_LENGTH = _REPLY.size - proto.HEADER_BYTES

# A frame as ``sockets.read_frame`` returns it: its header and payload (None for a CHUNK).
Frame = tuple[proto.Header, "bytearray | None"]


class LookupThread:
    """The thread that answers one connection's LOOKUPs (see the module)."""

    def __init__(self, sock: socket.socket, lookup: Callable[[Sequence[bytes]], int],
                 heard: Callable[[], None], *, chunk_bytes: int, payload_timeout: float,
                 send_timeout: float, max_payload: int = proto.MAX_CONTROL_PAYLOAD) -> None:
        self._sock = sock
        # Number of leading keys held (the store's lookup_prefix, thread-safe).
        self._lookup = lookup
        # Called on the thread with each whole frame read (the connection's liveness).
        self._heard = heard
        # The negotiated chunk size (a CHUNK header is checked against it, as on the loop).
        self._chunk_bytes = chunk_bytes
        self._payload_timeout = payload_timeout
        self._send_timeout = send_timeout
        self._max_payload = max_payload
        # Held around each socket call, and by stop(): none starts once stopped.
        self._lock = threading.Lock()
        self._stopped = False
        # Wakes the thread's poll at stop(); closed by the thread as it ends (-1 then).
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # LOOKUPs answered on the thread (for tests and the curious).
        self.answered = 0

    async def run(self) -> Frame | None:
        """Serve on the thread; the first frame that is no LOOKUP (None when no thread could be
        started: the loop's reader serves the connection then). Raises what the thread hit."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Frame] = loop.create_future()
        wakes = loop_wakes(loop)

        def body() -> None:
            try:
                frame = self._serve()
            except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task)
                wakes.post(fut, None, exc)  # type: ignore[arg-type]
            else:
                wakes.post(fut, frame, None)  # type: ignore[arg-type]
            finally:
                with self._lock:
                    os.close(self._wake)
                    self._wake = -1

        try:
            threading.Thread(target=body, name="kv-offload-tcp-lookups", daemon=True).start()
        except RuntimeError:  # out of threads: the loop answers this connection's lookups
            with self._lock:
                os.close(self._wake)
                self._wake = -1
            return None
        try:
            return await fut
        finally:
            self.stop()

    def stop(self) -> None:
        """No socket call more once this returns (the one under way, if any, has ended)."""
        with self._lock:
            self._stopped = True
            if self._wake >= 0:
                os.eventfd_write(self._wake, 1)

    # ---- on the thread

    def _serve(self) -> Frame:
        sock = self._sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._wake, select.POLLIN)
        header_buf = bytearray(proto.HEADER_BYTES)
        usual = (proto.MAGIC, proto.WIRE_MAJOR, _LOOKUP)  # a LOOKUP's header starts so
        while True:
            poller.poll(-1)  # the next request, not yet sent as a rule: no receive tried before it
            self._fill(poller, header_buf, None)
            magic, major, mtype, rid, length = proto.HEADER.unpack(header_buf)
            if (magic, major, mtype) != usual or length > self._max_payload:
                header = proto.decode_header(header_buf, self._chunk_bytes, max_payload=self._max_payload)
                if header.type is proto.MessageType.CHUNK:  # no client sends one: the loop refuses it
                    return header, None
                payload = bytearray(header.length)
                if header.length:
                    self._fill(poller, payload, header.type.name)
                self._heard()
                return header, payload
            payload = bytearray(length)
            if length:
                self._fill(poller, payload, "LOOKUP")
            self._heard()
            count = self._lookup(proto.decode_keys(payload))
            self._send(_REPLY.pack(proto.MAGIC, proto.WIRE_MAJOR, _LOOKUP_REPLY, rid, _REPLY_LENGTH, count))
            self.answered += 1

    def _fill(self, poller: select.poll, buf: bytearray, payload_of: str | None) -> None:
        """Fill ``buf`` from the socket; a payload (of a frame of type ``payload_of``) within
        ``payload_timeout``."""
        deadline = None if payload_of is None else time.monotonic() + self._payload_timeout
        got, n = 0, len(buf)
        with memoryview(buf) as mv:
            while got < n:
                with self._lock:
                    if self._stopped:
                        raise ConnectionError("the connection was stopped")
                    try:
                        k = self._sock.recv_into(mv[got:])
                    except (BlockingIOError, InterruptedError):
                        k = -1
                if k == 0:
                    raise ConnectionError(f"connection closed after {got} of {n} bytes")
                if k > 0:
                    got += k
                    continue
                wait = -1
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise proto.ProtocolError(
                            "malformed", f"{payload_of} frame stalled: its {n}-byte "
                            f"payload did not arrive within {self._payload_timeout:.3g}s")
                    wait = max(1, int(left * 1000))
                poller.poll(wait)

    def _send(self, data: bytes) -> None:
        """Send ``data`` whole within ``send_timeout`` (the thread is the only writer)."""
        deadline = time.monotonic() + self._send_timeout
        view = memoryview(data)
        poller: select.poll | None = None
        while view:
            with self._lock:
                if self._stopped:
                    raise ConnectionError("the connection was stopped")
                try:
                    sent = self._sock.send(view)
                except (BlockingIOError, InterruptedError):
                    sent = 0
            view = view[sent:]
            if not view:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a LOOKUP_REPLY did not leave within {self._send_timeout:.3g}s")
            if poller is None:
                poller = select.poll()
                poller.register(self._sock.fileno(), select.POLLOUT)
                poller.register(self._wake, select.POLLIN)
            poller.poll(max(1, int(left * 1000)))


__all__ = ["Frame", "LookupThread"]
