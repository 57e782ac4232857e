"""The holder's side of a NIXL connection: a view of the store to read, and the leases on it.

``StoreView``: each authenticated connection gets its own read-only mapping of the store
file, registered with lane 0's agent; the connection receives the partial agent metadata
of that registration only (its remote key and the agent's connection info), sealed under
its session key. When the connection ends (closed, failed, or its session no longer
authorised) the view is deregistered and its address range *darkened*: the store file's
mapping there is replaced in place (``MAP_FIXED``) by an anonymous read-only mapping of
zeros, so the remote key and the addresses it names are dead: a late READ through them
reads zeros (its checksum fails) instead of the store. Deregistering alone is not enough:
over cma (UCX's choice between processes of one PID namespace) a READ is a
``process_vm_readv`` of the holder's address, which the kernel checks against the holder's
mappings, not against NIXL's registrations. An unmapped range would leave a hole that the
holder's next large allocation may fill, and a kept address would then read that memory.
Zeros rather than PROT_NONE: over UCX's tcp transport the holder's own UCX sends a READ's
bytes from the range, and a send still under way when the fetcher gave up and the view was
revoked would fault on a PROT_NONE page and kill the holder; it reads zeros instead.

The dark ranges are kept, one per revoked view, and the next view takes the one darkest
longest instead of mapping anew, so the address space held never exceeds the most views
live at once. (Over cma, metadata kept past its revoke can again read the store once its
range is lent to a new connection; a process that cma reaches could read the holder's
memory without any metadata anyway, since the kernel only asks that it may ptrace the
holder. On RDMA transports the deregistered remote key fails every late READ.)

``Leases``: a chunk offered to a fetcher (CHUNK_AT) stays pinned -- neither evicted nor
overwritten -- until the fetcher RELEASEs it, its lease of ``lease_seconds`` runs out, or
the connection ends. A READ after the lease ran out may see other bytes; the fetcher's
checksum then fails and the chunk is not stored.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from collections import deque
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
# Revoked views' mappings, dark (zeros), oldest first, by the store file's (device,
# inode, mapped size): each is lent again to a later view of that file instead of a new mapping.
_dark: dict[tuple[int, int, int], deque[mmap.mmap]] = {}

# mmap(2)'s MAP_FIXED on Linux (the mmap module does not name it): replace what is mapped there.
MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)


def _map_over(base: int, size: int, flags: int, fd: int = -1) -> None:
    """Map ``fd`` (-1: anonymous zeros) read-only over ``[base, base + size)`` in place."""
    got = _libc.mmap(base, size, mmap.PROT_READ, flags | MAP_FIXED, fd, 0)
    if got is None or got == ctypes.c_void_p(-1).value or got != base:
        err = ctypes.get_errno()
        raise OSError(err, f"remapping a store view: {os.strerror(err)}")


def _address_of(mapping: mmap.mmap) -> int:
    import numpy as np

    return int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)


def live_views() -> int:
    """Views of this process's store exported to connections and not yet revoked."""
    return len(_live)


def exported_views() -> int:
    """Views this process ever exported (each to one authenticated connection)."""
    return _exported[0]


def dark_views() -> int:
    """Ranges of revoked views kept dark (reading zeros), waiting to be lent to a later view."""
    return sum(len(q) for q in _dark.values())


def forget_dark_views(path: str) -> int:
    """Unmap the dark ranges of the store file at ``path`` (its server stopped; they would
    keep the file's memory alive after it is removed). How many went."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    n = 0
    for key in [k for k in _dark if k[:2] == (st.st_dev, st.st_ino)]:
        for mapping in _dark.pop(key):
            mapping.close()
            n += 1
    return n


def _lend_range(path: str, size: int) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """A read-only mapping of ``path``'s first ``size`` bytes (the range darkest longest, or
    a new one) and the key its range goes back under."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, size)
        waiting = _dark.get(key)
        if waiting:
            mapping = waiting.popleft()
            _map_over(_address_of(mapping), size, mmap.MAP_SHARED, fd)  # the store again
            return mapping, key
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), key
    finally:
        os.close(fd)


def _darken(key: tuple[int, int, int], mapping: mmap.mmap) -> None:
    """Make ``mapping``'s range read zeros for anyone (cma included), never the store, and
    keep the range for a later view."""
    try:
        _map_over(_address_of(mapping), key[2], mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # never leave it readable: give the range back instead
        log.warning("NIXL: %s; unmapping the view", exc)
        mapping.close()
        return
    _dark.setdefault(key, deque()).append(mapping)


class StoreView:
    """One connection's read-only, registered mapping of the store file."""

    def __init__(self, runtime: NixlRuntime, mapping: mmap.mmap, base: int, registration: Any,
                 exported: ExportedView, range_key: tuple[int, int, int]) -> None:
        self._runtime = runtime
        self._mapping = mapping
        self._range_key = range_key
        self._registration = registration
        self.base = base
        # What the connection is told (sealed): geometry, agent name, partial metadata.
        self.exported = exported
        _live.add(id(self))
        _exported[0] += 1

    @classmethod
    async def create(cls, runtime: NixlRuntime, store: Any) -> StoreView:
        """Map ``store``'s file read-only and register the mapping with lane 0's agent."""
        size = store.num_slots * store.slot_stride
        mapping, range_key = _lend_range(store.path, size)
        base = _address_of(mapping)

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
            _darken(range_key, mapping)
            raise
        runtime.wireup_window()
        exported = ExportedView(base, store.slot_stride, store.slot_bytes, store.num_slots,
                                runtime.serving.name, metadata)
        return cls(runtime, mapping, base, registration, exported, range_key)

    async def revoke(self) -> None:
        """Deregister and darken: the remote key and addresses given out are dead. Idempotent."""
        if self._registration is None:
            return
        registration, self._registration = self._registration, None
        try:
            await self._runtime.serving.call(lambda lane: lane.agent.deregister_memory(registration))
        except Exception as exc:
            log.warning("NIXL: deregistering a connection's view failed: %s", exc)
        finally:
            _darken(self._range_key, self._mapping)
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
