"""A local-channel connection's first frame, read with ``recvmsg`` so it may carry a descriptor.

The tier hands over the file behind vLLM's primary region as SCM_RIGHTS
ancillary data of an ``attach_region`` frame, the first frame of its own
connection. asyncio's streams drop ancillary data, so the server reads each
connection's first frame here (a non-blocking ``recv_fds`` awaited on
readability) and only then wraps the socket in streams. At most ``MAX_FDS``
descriptors per frame; any more, or a frame over ``MAX_FRAME_BYTES``, is a
``FirstFrameError`` with the counted reason, and every descriptor received is
closed on any failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

from kv_offload_sidecar.engine import channel_protocol as cp


class FirstFrameError(Exception):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


async def first_frame(sock: socket.socket) -> tuple[bytes, list[int], bytes] | None:
    """(body, descriptors, bytes after it) of a connection's first frame; None on a clean close.

    Read with ``recvmsg`` so the frame may carry descriptors (at most ``MAX_FDS``).
    """
    loop = asyncio.get_running_loop()
    buf = bytearray()
    fds: list[int] = []
    need = cp.LENGTH.size
    try:
        while len(buf) < need:
            chunk, got = await recv_fds(loop, sock, max(need - len(buf), 4096))
            fds.extend(got)
            if len(fds) > MAX_FDS:
                raise FirstFrameError(f"a frame may carry at most {MAX_FDS} descriptor", "malformed")
            if not chunk:
                if buf:
                    raise FirstFrameError("connection closed inside a frame", "malformed")
                return None
            buf += chunk
            if need == cp.LENGTH.size and len(buf) >= need:
                try:
                    need += cp.frame_length(bytes(buf[:need]))
                except ValueError as exc:
                    raise FirstFrameError(str(exc), "oversize") from None
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    return bytes(buf[cp.LENGTH.size:need]), fds, bytes(buf[need:])


# Most descriptors one local-channel frame may carry (attach_region's one).
MAX_FDS = 1


async def recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    size: int) -> tuple[bytes, list[int]]:
    """One ``recv_fds`` of a non-blocking socket, awaiting readability."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, size, MAX_FDS + 1)
            return data, list(fds)
        except BlockingIOError:
            pass
        ready = loop.create_future()
        loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())


__all__ = ["FirstFrameError", "MAX_FDS", "first_frame"]
