"""What crosses a PodNetwork's router, and the TCP connections its pods hold.

- ``datagram_crosses(net, a, b)``: a UDP datagram from pod ``a`` reaches pod ``b``
  within ``timeout`` (False after it: the only wait here that proves an absence, and
  it is meant short; callers prove the other direction first with the same probe);
- ``transfer_rate(net, a, b, nbytes)``: bytes per second of one TCP transfer from ``a``
  to ``b``, through the router (and its tbf caps);
- ``tcp_connections(pod)``: the pod's TCP connections (``ss -tn`` in its namespace);
  ``half_open(net)``: connections one pod holds open (any state but TIME-WAIT) to another
  pod that holds no end of them (a silent partition ended the other side's).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from kv_offload_tools.netns.ip import in_netns, inside
from kv_offload_tools.netns.network import Pod, PodNetwork


def datagram_crosses(net: PodNetwork, a: int | Pod, b: int | Pod, timeout: float = 0.5) -> bool:
    """True when a datagram sent from ``a`` to ``b`` arrives within ``timeout`` seconds."""
    src, dst = net.pod(a), net.pod(b)
    with inside(dst.netns):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with inside(src.netns):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind((dst.ip, 0))
        rx.settimeout(timeout)
        token = f"probe {src.ip}->{dst.ip} {time.monotonic_ns()}".encode()
        tx.sendto(token, rx.getsockname())
        try:
            while True:
                if rx.recv(256) == token:
                    return True
        except socket.timeout:
            return False


def transfer_rate(net: PodNetwork, a: int | Pod, b: int | Pod, nbytes: int, timeout: float = 30.0) -> float:
    """Bytes per second of sending ``nbytes`` over TCP from ``a`` to ``b`` (until ``b`` read all)."""
    src, dst = net.pod(a), net.pod(b)
    with inside(dst.netns):
        listener = socket.create_server((dst.ip, 0))
    received = [0]
    done = threading.Event()

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            while received[0] < nbytes:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                received[0] += len(chunk)
        done.set()

    with listener:
        listener.settimeout(timeout)
        reader = threading.Thread(target=receive, name="kvn-rate-rx", daemon=True)
        reader.start()
        with inside(src.netns):
            tx = socket.create_connection(listener.getsockname(), timeout=timeout)
        with tx:
            t0 = time.monotonic()
            tx.sendall(bytes(nbytes))
            done.wait(timeout)
            elapsed = time.monotonic() - t0
        reader.join(timeout)
    if received[0] < nbytes:
        raise TimeoutError(f"{dst.ip} received {received[0]} of {nbytes} bytes from {src.ip}")
    return nbytes / elapsed


@dataclass(frozen=True)
class Connection:
    """One TCP connection as ``ss`` shows it."""

    state: str
    local: str
    remote: str


def tcp_connections(pod: Pod) -> list[Connection]:
    """The pod's TCP connections, listeners excluded."""
    out = in_netns(pod.netns, ["ss", "-tnH", "state", "all"])
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] != "LISTEN":
            rows.append(Connection(parts[0], parts[3], parts[4]))
    return rows


def half_open(net: PodNetwork) -> list[tuple[Pod, Connection]]:
    """Connections a pod holds to another pod whose other end that pod no longer holds."""
    tables = {p.index: tcp_connections(p) for p in net.pods}
    by_ip = {p.ip: p.index for p in net.pods}
    ends = {(c.local, c.remote) for rows in tables.values() for c in rows}
    lost = []
    for p in net.pods:
        for c in tables[p.index]:
            peer = by_ip.get(c.remote.rpartition(":")[0])
            if peer not in (None, p.index) and c.state != "TIME-WAIT" and (c.remote, c.local) not in ends:
                lost.append((p, c))
    return lost
