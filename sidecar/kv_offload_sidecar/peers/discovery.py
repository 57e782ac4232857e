"""Peer discovery: which control addresses ("host:port") to handshake with.

Sources, merged into one set:
- a static list (``--peers h:p,...``), fixed for the process lifetime;
- the DNS name of the pool's headless Service (``--peers-dns``; a name ending in
  ``.svc`` gets the pod's cluster domain, ``cluster_domain.qualify``), re-resolved
  every ``interval_seconds``; each address is tried on ``base + i`` for every
  DP index ``i`` in ``range(data_parallel_size)``, so pods join and leave the
  set while traffic runs. A failed resolution keeps the last answer;
- dynamic addresses of peers that handshook with us (they dial, we dial back),
  forgotten again (``forget_unreachable``, each pass of the links' loop) once our link to one
  has failed ``FORGET_AFTER_FAILURES`` times in a row (the pod left) or at once when it refused
  us as a stranger (``other_pool``: the address now belongs to a pod of another pool; or
  ``bad_proof``), so departed
  addresses are not dialled for ever and a reused one raises one refusal, not a stream.
  The peer is learnt again if it handshakes with us again.

The sidecar's own addresses are never offered. Addresses that turn out to be
another DP port of an already connected peer are de-duplicated by identity in
peers.py, which sees the identity in the handshake.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from kv_offload_sidecar.engine.contract.ports import DEFAULT_BASE_PORT
from kv_offload_sidecar.peers.cluster_domain import qualify
from kv_offload_sidecar.settings import PeerSettings
from kv_offload_sidecar.waits import set_within

log = logging.getLogger(__name__)

# Consecutive failed attempts after which a dynamic (learnt) address is forgotten.
FORGET_AFTER_FAILURES = 5
# Refusals after which a dynamic address is forgotten at once (its pod is not of this pool).
REFUSED_STRANGER = ("(other_pool)", "(bad_proof)")

# Resolver: name -> list of IP strings. The default asks the system resolver.
Resolver = Callable[[str], Awaitable[list[str]]]


def parse_peer(addr: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port``; ValueError says what to write."""
    text = addr.strip()
    host, sep, port_s = text.rpartition(":")
    if not sep or not host or not (port_s.isascii() and port_s.isdigit()):
        raise ValueError(f"peer address {addr!r} is not host:port (e.g. 10.0.0.7:5710)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"peer address {addr!r} has port {port} outside 1-65535")
    return host, port


def format_peer(host: str, port: int) -> str:
    """``host:port`` with IPv6 literals bracketed."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def parse_peer_list(text: str | Sequence[str]) -> tuple[str, ...]:
    """Comma-separated (or listed) peers, normalised; empty items ignored."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for item in items:
        if item.strip():
            addr = format_peer(*parse_peer(item))
            if addr not in out:
                out.append(addr)
    return tuple(out)


async def system_resolver(name: str) -> list[str]:
    """All IPv4/IPv6 addresses of ``name`` from the system resolver."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    ips: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = str(sockaddr[0])
        if ip not in ips:
            ips.append(ip)
    return ips


class Discovery:
    """The current set of peer control addresses, updated in the background."""

    def __init__(self, *, static_peers: Iterable[str] = (), dns_name: str = "",
                 base_port: int = DEFAULT_BASE_PORT, dp_size: int = 1,
                 interval_seconds: float = PeerSettings.dns_interval_seconds,
                 own_addresses: Iterable[str] = (), resolver: Resolver | None = None) -> None:
        self._static = set(parse_peer_list(list(static_peers)))
        self._dns_name = qualify(dns_name)
        self._base_port = base_port
        self._dp_size = max(1, dp_size)
        self._interval = interval_seconds
        self._own = {format_peer(*parse_peer(a)) for a in own_addresses}
        self._resolver = resolver or system_resolver
        self._dns: set[str] = set()
        self._dynamic: set[str] = set()
        self._changed = asyncio.Event()

    def current(self) -> set[str]:
        """Every address to keep a session with (own addresses excluded)."""
        return (self._static | self._dns | self._dynamic) - self._own

    def add_dynamic(self, addr: str) -> None:
        """Remember a peer that reached us (it is dialled back)."""
        try:
            norm = format_peer(*parse_peer(addr))
        except ValueError:
            log.warning("ignoring peer with unusable control address %r", addr)
            return
        if norm not in self.current() and norm not in self._own:
            self._dynamic.add(norm)
            self._changed.set()

    def remove_dynamic(self, addr: str) -> None:
        if addr in self._dynamic:
            self._dynamic.discard(addr)
            self._changed.set()

    def forget_unreachable(self, links: Iterable[Any]) -> list[str]:
        """Forget the dynamic addresses whose link (``address``, ``state``, ``failures``,
        ``last_error``) failed too often or refused us (other_pool, bad_proof); returns them."""
        gone = []
        for link in links:
            if link.address not in self._dynamic or link.address in self._static | self._dns:
                continue
            refused = link.state == "rejected" and any(r in link.last_error for r in REFUSED_STRANGER)
            if refused or link.failures >= FORGET_AFTER_FAILURES:
                log.info("forgetting learnt peer %s (%s)", link.address, link.last_error or "unreachable")
                self.remove_dynamic(link.address)
                gone.append(link.address)
        return gone

    async def resolve_once(self) -> set[str]:
        """Re-resolve the DNS name; keeps the last answer when resolution fails."""
        if not self._dns_name:
            return set()
        try:
            ips = await self._resolver(self._dns_name)
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("resolving peers DNS name %r failed (%s); keeping %d known addresses",
                        self._dns_name, exc, len(self._dns))
            return self._dns
        found = {format_peer(ip, self._base_port + i) for ip in ips for i in range(self._dp_size)}
        if found != self._dns:
            joined, left = found - self._dns, self._dns - found
            if joined or left:
                log.info("peers DNS %r: %d joined, %d left", self._dns_name, len(joined), len(left))
            self._dns = found
            self._changed.set()
        return found

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until the set may have changed (or ``timeout``); clears the flag."""
        if not await set_within(self._changed, timeout):
            return False
        self._changed.clear()
        return True

    async def run(self) -> None:
        """Re-resolve forever (a cleanup_ctx task; cancelled at shutdown)."""
        if not self._dns_name:
            return
        while True:
            await self.resolve_once()
            await asyncio.sleep(self._interval)
