"""The NIXL data-plane server: the TCP server's connection handling, chunks offered for READ.

A connection authenticates exactly as on the TCP transport (nonce, session HMAC). Only
then does it get a ``StoreView`` and its sealed NIXL_METADATA; nothing about the holder's
memory reaches a connection before that. A FETCH is answered with a CHUNK_AT (key,
checksum, slot; the chunk pinned under a lease) or CHUNK_MISSING per key, no chunk bytes:
the fetcher READs them itself. Every ``SWEEP_SECONDS`` the server ends leases that ran out;
the TCP server closes connections whose session is no longer authorised (its key was
retired, ``serving.ProvenConnections``); a connection that ends has its view revoked before
its pins are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import Authorize, StoreLike
from kv_offload_sidecar.data.nixl.exports import (
    DEFAULT_LEASE_SECONDS,
    Leases,
    StoreView,
    forget_dark_views,
)
from kv_offload_sidecar.data.nixl.frames import decode_release, encode_chunk_at, encode_metadata
from kv_offload_sidecar.data.nixl.runtime import NixlRuntime
from kv_offload_sidecar.data.tcp.server import TcpDataPlaneServer, _ConnState

if TYPE_CHECKING:
    from kv_offload_sidecar.data.tcp.sockets import DataStream
    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Seconds between sweeps of expired leases and ended sessions.
SWEEP_SECONDS = 0.25
# Chunks one connection may hold pinned at once; past it a FETCH key is CHUNK_MISSING (a
# fetcher keeps a window of 16 in flight, so only a peer that never releases reaches it).
MAX_LEASES_PER_CONNECTION = 256


class _Connection:
    """What the NIXL server keeps per authenticated connection."""

    def __init__(self, session_id: bytes, stream: DataStream, view: StoreView, leases: Leases) -> None:
        self.session_id = session_id
        self.stream = stream
        self.view = view
        self.leases = leases


class NixlDataPlaneServer(TcpDataPlaneServer):
    """Offers this sidecar's chunks to authenticated peers for one-sided NIXL READs."""

    def __init__(self, store: StoreLike, authorize: Authorize, metrics: SidecarMetrics | None, *,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, **options: Any) -> None:
        for name in ("path", "num_slots", "slot_stride"):
            if not hasattr(store, name):
                raise ValueError(f"the nixl transport serves a ChunkStore (its file is mapped for "
                                 f"peers); {type(store).__name__} has no {name!r}")
        if options.get("ssl") is not None:
            raise ValueError("TLS encrypts the tcp data plane only, not 'nixl': "
                             "use transport tcp with TLS, or leave the TLS context out")
        super().__init__(store, authorize, metrics, **options)
        self._lease_seconds = lease_seconds
        self._runtime: NixlRuntime | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._live: dict[int, _Connection] = {}

    async def start(self) -> str:
        """Start the NIXL agents, register this store for fetching, listen; ``nixl://host:port``."""
        self._runtime = await NixlRuntime.get()
        await self._runtime.register_local(self._store)
        address = await super().start()
        self.address = "nixl://" + address.split("://", 1)[1]
        self._sweeper = asyncio.create_task(self._sweep(), name="nixl-lease-sweep")
        return self.address

    async def stop(self, grace_seconds: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await super().stop(grace_seconds)
        forget_dark_views(self._store.path)  # every view was revoked; the store may go now

    @property
    def leased(self) -> int:
        """Chunks pinned for connections' reads right now."""
        return sum(len(c.leases) for c in self._live.values())

    async def _on_authenticated(self, stream: DataStream, session_id: bytes, nonce: bytes) -> Any:
        assert self._runtime is not None
        key = self._authorize(session_id)
        if not key:  # the session ended between the proof and now
            raise proto.ProtocolError("unauthenticated", "session ended; handshake again")
        try:
            view = await StoreView.create(self._runtime, self._store)
        except Exception as exc:  # NIXL could not map or register: this peer gets nothing
            log.warning("NIXL data plane: cannot export the store to a peer: %s", exc)
            raise ConnectionError(f"exporting the store failed: {exc}") from exc
        conn = _Connection(session_id, stream, view, Leases(self._lease_seconds))
        self._live[id(conn)] = conn
        try:
            await stream.send(encode_metadata(view.exported, key, nonce))
        except BaseException:
            self._live.pop(id(conn), None)
            await view.revoke()
            raise
        return conn

    async def _on_frame(self, state: _ConnState, header: proto.Header, payload: bytearray) -> bool:
        if header.type is not proto.MessageType.RELEASE:
            return False
        released = state.extra.leases.release(decode_release(payload))
        if self._metrics is not None and released:
            self._metrics.peer_bytes.labels(direction="sent").inc(released * self._chunk_bytes)
        return True

    async def _on_closed(self, state: _ConnState) -> None:
        conn: _Connection = state.extra
        self._live.pop(id(conn), None)
        try:
            await asyncio.shield(conn.view.revoke())  # first: no READ reaches the slots after this
        except BaseException as exc:
            log.warning("NIXL data plane: revoking a view: %s", exc)
        conn.leases.release_all()

    async def _send_chunks(self, stream: DataStream, request_id: int, keys: list[bytes],
                           state: _ConnState | None = None) -> None:
        """CHUNK_AT (the chunk pinned under a lease) or CHUNK_MISSING per key, one send."""
        if state is None or state.extra is None:
            return
        leases: Leases = state.extra.leases
        assert self._runtime is not None
        self._runtime.serving_window()  # the fetcher lane's first READ may wire up now
        frames: list = []
        for i, key in enumerate(keys):
            rid = (request_id + i) % proto.REQUEST_ID_MOD
            pin = self._store.pin(key) if len(leases) < MAX_LEASES_PER_CONNECTION else None
            if pin is None:
                frames += proto.encode_chunk_missing(rid, key)
            else:
                leases.add(rid, pin)
                frames += encode_chunk_at(rid, key, pin.checksum, pin.slot)
        async with asyncio.timeout(self._send_timeout):
            await stream.send(frames)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            for conn in list(self._live.values()):
                expired = conn.leases.expire()
                if expired:
                    log.info("NIXL data plane: %d leases ran out unreleased", expired)
