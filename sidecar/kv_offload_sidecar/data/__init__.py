"""The data plane: moves whole chunks between peer sidecars' stores.

Three transports behind one interface (``base.DataPlaneServer`` /
``base.PeerDataClient``): ``tcp`` (asyncio sockets), ``ucx`` (``ucxx`` tag
messages, shared memory or TCP underneath) and ``nixl`` (the fetcher READs the holder's
slot into its own with NVIDIA NIXL, one-sided: CMA between processes, RDMA with a device;
its requests travel on a TCP connection). ``make_server(kind, ...)`` picks one by
config, ``connect(address, ...)`` by the scheme of the address the peer advertised
in its handshake (``tcp://host:port``, ``tls://host:port``, ``ucx://<base64 worker address>``
or ``nixl://host:port``); both live in ``planes``. ``ucxx`` and ``nixl_cu12`` are imported
only by their transport.

TCP may run under mutual TLS (``tls.server_context`` / ``tls.client_context``, passed
as ``ssl=``): the server then advertises ``tls://``, and a client with a context
connects only to ``tls://`` peers, one without only to ``tcp://`` ones.

Modules: ``base`` (the interfaces every plane implements, and the session proof), ``planes``
(which plane serves and which dials), ``address``, ``protocol`` (frames), ``fetch`` (the
client side of a fetch), ``peer_client`` (what the planes' clients share), ``before_auth``,
``tls`` and one folder per plane.

This package imports none of its modules when it is loaded: the names below are looked up
on first use, so a module of the package never runs while the package is half loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_offload_sidecar.data.address import parse_address
    from kv_offload_sidecar.data.base import (
        Authorize,
        DataPlaneServer,
        IntegrityError,
        PeerDataClient,
        ReceiveStopped,
        StoreLike,
        TransportError,
    )
    from kv_offload_sidecar.data.planes import connect, make_server

__all__ = [
    "Authorize", "DataPlaneServer", "IntegrityError", "PeerDataClient", "ReceiveStopped",
    "StoreLike", "TransportError", "connect", "make_server", "parse_address",
]

# Public name -> the module that defines it.
_HOMES = {
    "Authorize": "base", "DataPlaneServer": "base", "IntegrityError": "base",
    "PeerDataClient": "base", "ReceiveStopped": "base", "StoreLike": "base", "TransportError": "base",
    "connect": "planes", "make_server": "planes", "parse_address": "address",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
