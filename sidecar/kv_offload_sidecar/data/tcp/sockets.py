"""Non-blocking socket primitives of the TCP data plane: exact receives into buffers,
scatter-gather sends, frame reads and the ``tcp://host:port`` address.
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

from kv_offload_sidecar.data import protocol as proto

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)


# Socket buffer size asked for on data connections; 0 leaves Linux's autotuning on,
# which grows the buffers past net.core.*mem_max (a fixed size would cap them there).
SOCKET_BUFFER_BYTES = 0


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


def send_now(sock: socket.socket, frame: list) -> list:
    """Send a small frame right away (no writer hop); returns what the socket did not take."""
    data = proto.join(frame)
    try:
        sent = sock.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    return [data[sent:]] if sent < len(data) else []


def poll_readable(sock: socket.socket, seconds: float) -> None:
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
