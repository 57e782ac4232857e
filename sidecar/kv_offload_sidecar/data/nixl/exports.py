"""The holder's side of a NIXL connection: a view of the store to read, and the leases on it.

``StoreView``: each authenticated connection gets its own read-only mapping of the store
file, registered with lane 0's agent; the connection receives the partial agent metadata
of that registration only (its remote key and the agent's connection info), sealed under
its session key. When the connection ends (closed, failed, or its session no longer
authorised) the view is deregistered and unmapped, so the remote key and the addresses it
names are dead: a late READ through them fails instead of reading the store.

``Leases``: a chunk offered to a fetcher (CHUNK_AT) stays pinned -- neither evicted nor
overwritten -- until the fetcher RELEASEs it, its lease of ``lease_seconds`` runs out, or
the connection ends. A READ after the lease ran out may see other bytes; the fetcher's
checksum then fails and the chunk is not stored.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Any

from kv_offload_sidecar.data.nixl.frames import ExportedView
from kv_offload_sidecar.data.nixl.runtime import NixlRuntime

log = logging.getLogger(__name__)

# Seconds a chunk offered to a fetcher stays pinned without a RELEASE.
DEFAULT_LEASE_SECONDS = 10.0

# Views exported and not yet revoked in this process (for status and tests).
_live: set[int] = set()
# Views ever exported by this process.
_exported = [0]


def live_views() -> int:
    """Views of this process's store exported to connections and not yet revoked."""
    return len(_live)


def exported_views() -> int:
    """Views this process ever exported (each to one authenticated connection)."""
    return _exported[0]


class StoreView:
    """One connection's read-only, registered mapping of the store file."""

    def __init__(self, runtime: NixlRuntime, mapping: mmap.mmap, base: int, registration: Any,
                 exported: ExportedView) -> None:
        self._runtime = runtime
        self._mapping = mapping
        self._registration = registration
        self.base = base
        # What the connection is told (sealed): geometry, agent name, partial metadata.
        self.exported = exported
        _live.add(id(self))
        _exported[0] += 1

    @classmethod
    async def create(cls, runtime: NixlRuntime, store: Any) -> StoreView:
        """Map ``store``'s file read-only and register the mapping with lane 0's agent."""
        import numpy as np

        size = store.num_slots * store.slot_stride
        fd = os.open(store.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        base = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)

        def register(lane: Any) -> tuple[Any, bytes]:
            reg = lane.agent.register_memory([(base, size, 0, "")], "DRAM")
            try:
                return reg, bytes(lane.agent.get_partial_agent_metadata(reg, True))
            except BaseException:
                lane.agent.deregister_memory(reg)
                raise

        try:
            registration, metadata = await runtime.serving.call(register)
        except BaseException:
            mapping.close()
            raise
        runtime.wireup_window()
        exported = ExportedView(base, store.slot_stride, store.slot_bytes, store.num_slots,
                                runtime.serving.name, metadata)
        return cls(runtime, mapping, base, registration, exported)

    async def revoke(self) -> None:
        """Deregister and unmap: the remote key and addresses given out are dead. Idempotent."""
        if self._registration is None:
            return
        registration, self._registration = self._registration, None
        try:
            await self._runtime.serving.call(lambda lane: lane.agent.deregister_memory(registration))
        except Exception as exc:
            log.warning("NIXL: deregistering a connection's view failed: %s", exc)
        finally:
            self._mapping.close()
            _live.discard(id(self))


class Leases:
    """Pins held for one connection's CHUNK_AT offers, by request id."""

    def __init__(self, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self._seconds = lease_seconds
        # request id -> (pin, monotonic expiry)
        self._pins: dict[int, tuple[Any, float]] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, request_id: int, pin: Any) -> None:
        old = self._pins.pop(request_id, None)
        if old is not None:  # a request id reused before its release: the old lease ends
            old[0].release()
        self._pins[request_id] = (pin, time.monotonic() + self._seconds)

    def release(self, request_ids: list[int]) -> int:
        """Unpin the leases of ``request_ids`` (unknown ids are ignored); how many ended."""
        n = 0
        for rid in request_ids:
            entry = self._pins.pop(rid, None)
            if entry is not None:
                entry[0].release()
                n += 1
        return n

    def expire(self, now: float | None = None) -> int:
        """Unpin leases past their expiry; how many."""
        now = time.monotonic() if now is None else now
        late = [rid for rid, (_, until) in self._pins.items() if until <= now]
        return self.release(late)

    def release_all(self) -> int:
        return self.release(list(self._pins))
