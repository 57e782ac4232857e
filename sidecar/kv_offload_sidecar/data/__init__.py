"""The data plane: moves whole chunks between peer sidecars' stores.

Two transports behind one interface (``base.DataPlaneServer`` /
``base.PeerDataClient``): ``tcp`` (asyncio sockets) and ``ucx`` (``ucxx`` tag
messages, shared memory or TCP underneath). ``make_server(kind, ...)`` picks one by
config, ``connect(address, ...)`` by the scheme of the address the peer advertised
in its handshake (``tcp://host:port`` or ``ucx://<base64 worker address>``).
``ucxx`` is imported only when the UCX transport is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data.base import (
    Authorize,
    DataPlaneServer,
    IntegrityError,
    PeerDataClient,
    StoreLike,
    TransportError,
    parse_address,
)

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

from kv_offload_sidecar.settings import TRANSPORTS

__all__ = [
    "Authorize", "DataPlaneServer", "IntegrityError", "PeerDataClient",
    "StoreLike", "TransportError", "connect", "make_server", "parse_address",
]


def make_server(
    kind: str,
    store: StoreLike,
    authorize: Authorize,
    metrics: SidecarMetrics | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    chunk_bytes: int,
    **options: Any,
) -> DataPlaneServer:
    """Build (not start) the data-plane server of transport ``kind``."""
    if kind == "tcp":
        from kv_offload_sidecar.data.tcp.server import TcpDataPlaneServer

        return TcpDataPlaneServer(store, authorize, metrics, host=host, port=port,
                                  chunk_bytes=chunk_bytes, **options)
    if kind == "ucx":
        from kv_offload_sidecar.data.ucx.server import UcxDataPlaneServer

        return UcxDataPlaneServer(store, authorize, metrics, host=host, port=port,
                                  chunk_bytes=chunk_bytes, **options)
    raise ValueError(f"unknown transport {kind!r}; use one of {list(TRANSPORTS)}")


async def connect(
    address: str,
    session_id: bytes,
    session_key: bytes,
    *,
    timeout: float,
    metrics: SidecarMetrics | None = None,
    **options: Any,
) -> PeerDataClient:
    """Open an authenticated data connection to the peer at ``address``.

    Raises ``TransportError`` when it cannot connect or authenticate in ``timeout``
    seconds, ``ValueError`` for an address that is neither tcp:// nor ucx://.
    """
    scheme, _ = parse_address(address)
    if scheme == "tcp":
        from kv_offload_sidecar.data.tcp.client import TcpPeerDataClient

        return await TcpPeerDataClient.connect(address, session_id, session_key,
                                               timeout=timeout, metrics=metrics, **options)
    from kv_offload_sidecar.data.ucx.client import UcxPeerDataClient

    return await UcxPeerDataClient.connect(address, session_id, session_key,
                                           timeout=timeout, metrics=metrics, **options)
