"""The kernel's liveness rule of every TCP socket the sidecar opens or accepts.

``keep_alive(sock)`` sets, on data connections (both ends, ``data.tcp.sockets.tune_socket``),
on the control ports' listeners (accepted connections inherit them, ``control.guarded_site``)
and on the sockets of the peer links' HTTP client (``peers.links``):

- TCP keepalive: a connection silent for ``KEEPALIVE_IDLE_SECONDS`` is probed every
  ``KEEPALIVE_INTERVAL_SECONDS``; ``KEEPALIVE_PROBES`` unanswered probes end it;
- ``TCP_USER_TIMEOUT``: data unacknowledged for ``USER_TIMEOUT_SECONDS`` ends it (and bounds
  the keepalive probing to the same time).

So the kernel ends a connection whose other end vanished behind a silent partition within
about ``USER_TIMEOUT_SECONDS`` plus one probe interval (5 s), on whichever side still holds
it, idle or not: no half-open connection outlives a cut by more. The links' heartbeats
(``peers.liveness``) notice a lost peer sooner; this rule is what ends the connections no
heartbeat runs on (a server's end, a pooled HTTP connection, a closed socket still sending
its FIN). Where an option is missing (not Linux) it is skipped.
"""

from __future__ import annotations

import contextlib
import socket

# Seconds a connection may be silent before the kernel probes it.
KEEPALIVE_IDLE_SECONDS = 1
# Seconds between keepalive probes.
KEEPALIVE_INTERVAL_SECONDS = 1
# Unanswered probes that end a connection.
KEEPALIVE_PROBES = 3
# Seconds data may stay unacknowledged (or probes unanswered) before the kernel ends the connection.
USER_TIMEOUT_SECONDS = 4


def keep_alive(sock: socket.socket) -> None:
    """Set this module's keepalive and ``TCP_USER_TIMEOUT`` on ``sock`` (a TCP socket)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_SECONDS), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_SECONDS),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", USER_TIMEOUT_SECONDS * 1000)):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
