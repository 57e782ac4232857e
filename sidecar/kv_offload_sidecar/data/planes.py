"""Which plane serves and which dials: ``make_server(kind, ...)`` builds the server of the
configured transport, ``connect(address, ...)`` the client the peer's address scheme names.
Each plane's modules (and ``ucxx``, ``nixl_cu12``) are imported only when it is picked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data.address import check_tls_policy, parse_address
from kv_offload_sidecar.settings import TRANSPORTS

if TYPE_CHECKING:
    from ssl import SSLContext

    from kv_offload_sidecar.data.base import Authorize, DataPlaneServer, PeerDataClient, StoreLike
    from kv_offload_sidecar.metrics import SidecarMetrics


def make_server(
    kind: str,
    store: StoreLike,
    authorize: Authorize,
    metrics: SidecarMetrics | None,
    *,
    chunk_bytes: int,
    ssl: SSLContext | None = None,
    **options: Any,
) -> DataPlaneServer:
    """Build (not start) the data-plane server of transport ``kind``; with ``ssl``
    (``tls.server_context``) the TCP one runs mutual TLS and advertises ``tls://``. ``options``
    go to the server's constructor: ``host`` and ``port`` to listen on (127.0.0.1 and a free
    port unless given), ``rejections``, a ``rejections.RejectionLog`` the refusals' lines go to
    (the sidecar's, shared with its control port; the server's own otherwise) and each
    server's own tunables."""
    if kind == "tcp":
        from kv_offload_sidecar.data.tcp.server import TcpDataPlaneServer

        return TcpDataPlaneServer(store, authorize, metrics, chunk_bytes=chunk_bytes, ssl=ssl, **options)
    if ssl is not None and kind in TRANSPORTS:
        raise ValueError(f"TLS encrypts the tcp data plane only, not {kind!r}: "
                         "use transport tcp with TLS, or leave the TLS context out")
    if kind == "ucx":
        from kv_offload_sidecar.data.ucx.server import UcxDataPlaneServer

        return UcxDataPlaneServer(store, authorize, metrics, chunk_bytes=chunk_bytes, **options)
    if kind == "nixl":
        from kv_offload_sidecar.data.nixl.server import NixlDataPlaneServer

        return NixlDataPlaneServer(store, authorize, metrics, chunk_bytes=chunk_bytes, **options)
    raise ValueError(f"unknown transport {kind!r}; use one of {list(TRANSPORTS)}")


async def connect(
    address: str,
    session_id: bytes,
    session_key: bytes,
    *,
    timeout: float,
    metrics: SidecarMetrics | None = None,
    ssl: SSLContext | None = None,
    lanes: int = 1,
    reached: Callable[[], None] | None = None,
    reach: str | None = None,
    **options: Any,
) -> PeerDataClient:
    """Open an authenticated data connection to the peer at ``address``.

    ``lanes``: connections a fetch stripes its chunks over (``data.lanes``), on tcp and
    tls; UCX and NIXL move a fetch over one endpoint (their own progress threads and lanes).

    ``reached``: called once the open has reached the holder's host: on tcp, tls and nixl when
    the TCP connection is made (before TLS and the proof, which need the holder's process).
    A UCX endpoint makes no connection to wait for: there ``reach``, another ``host:port`` of
    the holder's (its control port, whose kernel accepts while the process is slow), is
    dialled beside the open, and ``reached`` called once that TCP connection is made or
    refused (the host answered); without ``reach``, at the start.

    ``ssl`` (``tls.client_context``): this pod requires TLS; only a ``tls://`` peer is
    accepted then, and only without it a ``tcp://`` or ``ucx://`` one. Raises
    ``TransportError`` when it cannot connect, complete TLS or authenticate in
    ``timeout`` seconds, or when ``ssl`` and the peer's scheme disagree;
    ``ValueError`` for an address that is not tcp://, tls://, ucx:// or nixl://.
    """
    scheme, _ = parse_address(address)
    if scheme in ("tcp", "tls"):
        from kv_offload_sidecar.data.lanes import open_lanes
        from kv_offload_sidecar.data.tcp.client import TcpPeerDataClient

        return await open_lanes(lanes, lambda: TcpPeerDataClient.connect(
            address, session_id, session_key, timeout=timeout, metrics=metrics, ssl=ssl,
            reached=reached, **options))
    check_tls_policy(address, scheme, ssl)
    if scheme == "nixl":
        from kv_offload_sidecar.data.nixl.client import NixlPeerDataClient

        return await NixlPeerDataClient.connect(address, session_id, session_key, timeout=timeout,
                                                metrics=metrics, reached=reached, **options)
    from kv_offload_sidecar.data.ucx.client import UcxPeerDataClient

    probe = None
    if reached is not None:
        if reach is None:
            reached()
        else:
            probe = asyncio.create_task(dial_to_reach(reach, reached, timeout), name=f"reach {reach}")
    try:
        return await UcxPeerDataClient.connect(address, session_id, session_key,
                                               timeout=timeout, metrics=metrics, **options)
    finally:
        if probe is not None:
            probe.cancel()


async def dial_to_reach(address: str, reached: Callable[[], None], timeout: float) -> None:
    """``reached()`` once a TCP connection to ``address`` is made or refused within
    ``timeout`` (the host answered either way); nothing is sent on it."""
    from kv_offload_sidecar.data.tcp.sockets import split_host_port

    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(*split_host_port(address))
    except ConnectionRefusedError:
        reached()
        return
    except (OSError, TimeoutError, ValueError):
        return  # unreachable, no answer or no host:port: the open's own bound decides
    reached()
    writer.close()
