"""Peers that reach this sidecar but that it cannot reach: one side of an asymmetric partition.

A peer is *unreachable* from here when it holds an inbound session with this sidecar (it
dialled us and proved the pool key) while our own link to it (``links.PeerLink``, matched
by identity or by the control address its hello gave) has failed since it last connected
and is not connected now (backing off, rejected, or trying again). The
sidecar shows how many in ``kv_offload_peers_unreachable`` (a gauge read at each scrape), so
a pod that some members cannot reach is visible on those members; ``/v1/peers`` says which.
"""

from __future__ import annotations

from collections.abc import Iterable

from kv_offload_sidecar.peers.links import PeerLink

# Link states of a failing link (between two attempts, refused, or in an attempt).
DOWN_STATES = ("backoff", "rejected", "connecting")


def unreachable(links: Iterable[PeerLink], inbound: Iterable[tuple[str, str]]) -> list[str]:
    """Identities (or addresses) of the peers with an inbound session whose link is down."""
    identities: set[str] = set()
    addresses: set[str] = set()
    for identity, address in inbound:
        identities.add(identity)
        addresses.add(address)
    connected = {link.identity for link in links if link.state == "connected"}
    out = []
    for link in links:
        if link.state in DOWN_STATES and link.failures > 0 and link.identity not in connected and \
                (link.identity in identities or link.address in addresses):
            out.append(link.identity or link.address)
    return sorted(set(out))
