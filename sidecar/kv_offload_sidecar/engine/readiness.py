"""Whether one socket is readable, by ``poll(2)``: never ``select.select``.

``select.select`` raises ``ValueError`` for a descriptor of 1,024 or more (``FD_SETSIZE``),
which a sidecar of a large pool (about 18 sockets per peer with 8 lanes) and vLLM's own
process (the tier's lookups run inside it, beside its many files and sockets) both reach.
``poll`` has no such limit. Standard library only (it runs inside vLLM too).
"""

from __future__ import annotations

import select
import socket

_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def readable(sock: socket.socket, timeout: float = 0.0) -> bool:
    """Whether ``sock`` has data (or an error or hang-up to read), waiting at most ``timeout``
    seconds (0: look only)."""
    poller = select.poll()
    poller.register(sock.fileno(), _READABLE)
    return bool(poller.poll(max(0, int(timeout * 1000 + 0.999))))


__all__ = ["readable"]
