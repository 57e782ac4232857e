"""Data addresses: the ``scheme://rest`` a peer advertises in its handshake, and whether this
pod may dial it (its TLS setting and the peer's scheme must agree)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_offload_sidecar.data.base import TransportError

if TYPE_CHECKING:
    from ssl import SSLContext

# Schemes of data addresses: plain TCP, TCP under TLS, UCX, NIXL (its TCP control port).
ADDRESS_SCHEMES = ("tcp", "tls", "ucx", "nixl")


def parse_address(address: str) -> tuple[str, str]:
    """Split ``scheme://rest``; the scheme picks the transport (``tls`` is the TCP one, encrypted)."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ADDRESS_SCHEMES or not rest:
        raise ValueError(f"data address {address!r} is not tcp://host:port, tls://host:port, "
                         "ucx://<worker address> or nixl://host:port")
    return scheme, rest


def check_tls_policy(address: str, scheme: str, ssl: SSLContext | None) -> None:
    """TransportError unless this pod's TLS setting (``ssl``) and the peer's scheme agree."""
    if scheme == "tls" and ssl is None:
        raise TransportError(f"peer {address} encrypts its data plane (TLS) and this pod does not: "
                             "give this sidecar --tls-cert-file, --tls-key-file and --tls-ca-file "
                             "(a certificate of the pool's CA)")
    if scheme != "tls" and ssl is not None:
        serves = {"tcp": "plain TCP", "ucx": "UCX, which is not encrypted",
                  "nixl": "NIXL one-sided reads, which are not encrypted"}.get(scheme, scheme)
        raise TransportError(f"this pod requires TLS; peer {address} serves {serves} on its data plane "
                             "and is not dialled: give every pool member the --tls-* flags (and --transport tcp)")
