"""The sidecar's chunk store: fixed-size slots in one shared-memory file.

``ChunkStore`` owns the bookkeeping: which key lives in which slot, LRU order
over visible unpinned chunks, pins held while a chunk is sent or read, and
write reservations that become visible only at ``commit`` once their checksum
is computed (local writes) or verified (received chunks). A chunk is visible
whole or not at all and the store never uses more than ``num_slots`` slots,
so its memory never exceeds ``capacity_bytes``.

The slots live in ``{directory}/kv-offload-{name}.slots`` (``/dev/shm`` by
default), created ``O_EXCL`` mode 0600, sized and preallocated once and
mapped ``MAP_SHARED``, so the vLLM-side client of the same pod maps the same
file with ``ChunkStoreView.attach(...)`` and reads/writes slots without a copy.

Threading: one ``threading.Lock`` guards the bookkeeping; the data plane calls
from its asyncio loop and engine calls may come from other threads. Checksums
and ``on_change`` callbacks run outside the lock. Slot bytes are only touched
by the holder of a reservation (writer) or pins (readers), never under the lock.

The file itself is made by ``shm_file``; the engine maps it with
``kv_offload_sidecar.engine.store_view.ChunkStoreView``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES, check_key, checked_keys
from kv_offload_sidecar.engine.store_view import slot_stride_for, unmap
from kv_offload_sidecar.store.handles import PinnedChunk, WriteReservation
from kv_offload_sidecar.store.shm_file import (
    create_mapping,
    store_file_path,
    unlink_quietly,
)

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics


log = logging.getLogger(__name__)


DEFAULT_SHM_DIRECTORY = "/dev/shm"


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


OnChange = Callable[[bytes, bool], None]


@dataclass
class _Entry:
    # Slot index holding the chunk's bytes.
    slot: int
    # XXH3-64 of the chunk's slot_bytes.
    checksum: int
    # Number of live PinnedChunk handles; > 0 means never evicted.
    pins: int = 0
    # Forgotten at its last release (a peer's chunk the engine is loading: drop_when_released).
    transient: bool = False


class ChunkStore:
    """Byte-budgeted LRU store of fixed-size chunks in one shared-memory file."""

    def __init__(
        self,
        slot_bytes: int,
        capacity_bytes: int,
        *,
        directory: str = DEFAULT_SHM_DIRECTORY,
        name: str | None = None,
        metrics: SidecarMetrics | None = None,
        on_change: OnChange | None = None,
        replace_existing: bool = False,
    ) -> None:
        """Create, preallocate and map the store file.

        ``replace_existing`` unlinks a leftover file of the same name (a
        restarted sidecar) and, where /dev/shm holds one store, waits for its
        pages (``shm_file``); otherwise an existing file is an error.
        """
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(
                f"slot_bytes={slot_bytes!r} must be a positive integer "
                "(the pool's kv_bytes_per_chunk)"
            )
        stride = slot_stride_for(slot_bytes)
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes < stride
        ):
            raise ValueError(
                f"capacity_bytes={capacity_bytes!r} holds no chunk slot of {stride} bytes "
                f"(kv_bytes_per_chunk={slot_bytes} rounded up to the page size); "
                f"raise capacity_bytes to at least {stride}"
            )
        if name is None:
            name = f"{os.getpid()}-{secrets.token_hex(4)}"
        if not _NAME_RE.match(name):
            raise ValueError(
                f"store name={name!r} is invalid; use 1-128 characters of "
                "letters, digits, '.', '_' or '-' starting with a letter or digit"
            )
        if not os.path.isdir(directory):
            raise ValueError(
                f"store directory={directory!r} does not exist or is not a directory; "
                "mount a memory-backed volume there or pass another directory"
            )
        from kv_offload_sidecar.store.checksum import chunk_checksum

        self._checksum = chunk_checksum
        self._slot_bytes = slot_bytes
        self._slot_stride = stride
        self._capacity_bytes = capacity_bytes
        self._num_slots = capacity_bytes // stride
        self._path = store_file_path(directory, name)
        self._metrics = metrics
        self._on_change = on_change
        self._mm = create_mapping(self._path, self._num_slots * stride, replace_existing)
        self._mv = memoryview(self._mm)
        # Unlinks the file if the store is garbage-collected or the process exits unclosed.
        self._unlinker = weakref.finalize(self, unlink_quietly, self._path)

        self._lock = threading.Lock()
        self._closed = False
        # Free slots; popped from the end (lowest index first for locality).
        self._free: list[int] = list(range(self._num_slots - 1, -1, -1))
        # Visible chunks in LRU order: first = least recently used.
        self._visible: OrderedDict[bytes, _Entry] = OrderedDict()
        # Keys with a write in progress -> reserved slot.
        self._writing: dict[bytes, int] = {}
        self._evictions = 0
        self._integrity_failures = 0
        # (kind, key, slot) of reservations and pins garbage-collected without
        # commit/abort/release; appended lock-free by __del__, reclaimed under the lock.
        self._dropped: deque[tuple[str, bytes, int]] = deque()
        if metrics is not None:
            metrics.store_capacity_bytes.set(self._num_slots * stride)
        self._update_gauges_locked()

    # ---- geometry -----------------------------------------------------------------

    @property
    def path(self) -> str:
        """Path of the shared-memory file; the engine client attaches to it."""
        return self._path

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def slot_stride(self) -> int:
        return self._slot_stride

    @property
    def capacity_bytes(self) -> int:
        """The byte budget given; ``num_slots * slot_stride`` never exceeds it."""
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots in use (visible chunks plus writes in progress)."""
        with self._lock:
            self._reclaim_dropped_locked()
            return self._used_slots_locked() * self._slot_stride

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        """Number of visible chunks."""
        with self._lock:
            return len(self._visible)

    def slot_view(self, slot: int) -> memoryview:
        """Writable view of exactly ``slot_bytes`` of slot ``slot`` (no bookkeeping)."""
        self._check_open()
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._num_slots:
            raise IndexError(f"slot={slot!r} is out of range; the store has slots 0..{self._num_slots - 1}")
        start = slot * self._slot_stride
        return self._mv[start : start + self._slot_bytes]

    # ---- queries -------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True when ``key`` is visible (does not touch LRU order)."""
        key = check_key(key)
        with self._lock:
            return key in self._visible

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES and self.contains(key)

    def lookup_prefix(self, keys: Iterable[bytes], *, touch: bool = True) -> int:
        """Number of leading ``keys`` that are visible; marks them recently used
        (not with ``touch=False``: a peer's count, a routing hint, which use nothing).

        The prefix is touched back to front so its first chunk is the most
        recently used: eviction takes the tail of a prefix before its head.
        """
        checked = checked_keys(keys)
        with self._lock:
            self._check_open()
            self._reclaim_dropped_locked()
            visible = self._visible
            hits = 0
            for key in checked:
                if key not in visible:
                    break
                hits += 1
            if not touch:
                return hits
            move_to_end = visible.move_to_end
            for i in range(hits - 1, -1, -1):
                move_to_end(checked[i])
            return hits

    def demote(self, keys: Iterable[bytes]) -> int:
        """Move the visible ``keys`` to the cold end of the LRU; returns how many.

        Used for chunks copied from a peer: the pool already holds them, so
        this store evicts its copy first and keeps room for chunks only it has.
        The last key ends coldest, so a prefix keeps its head longest.
        """
        checked = checked_keys(keys)
        moved = 0
        with self._lock:
            self._check_open()
            for key in checked:
                if key in self._visible:
                    self._visible.move_to_end(key, last=False)
                    moved += 1
        return moved

    def drop_when_released(self, keys: Iterable[bytes]) -> int:
        """Forget the visible ``keys`` once nothing pins them (at once if nothing does now).

        Used for chunks fetched from a peer, once the engine has loaded them: the pool
        keeps them at their holder, so this store keeps no second copy and its slots
        stay for chunks only it has. Returns how many of ``keys`` were visible.
        """
        checked = checked_keys(keys)
        gone: list[bytes] = []
        marked = 0
        with self._lock:
            self._check_open()
            for key in checked:
                entry = self._visible.get(key)
                if entry is None:
                    continue
                marked += 1
                if entry.pins:
                    entry.transient = True
                else:
                    self._forget_locked(key, entry)
                    gone.append(key)
            self._update_gauges_locked()
        for key in gone:
            self._notify(key, False)
        return marked

    def _forget_locked(self, key: bytes, entry: _Entry) -> None:
        del self._visible[key]
        self._free.append(entry.slot)

    def checksum_of(self, key: bytes) -> int | None:
        """Checksum of the visible chunk ``key``, or None when it is not visible."""
        key = check_key(key)
        with self._lock:
            entry = self._visible.get(key)
            return None if entry is None else entry.checksum

    def keys(self) -> list[bytes]:
        """Visible keys, least recently used first."""
        with self._lock:
            return list(self._visible)

    def stats(self) -> dict[str, int | str]:
        """Snapshot of geometry and occupancy (for /v1/status and logs)."""
        with self._lock:
            self._reclaim_dropped_locked()
            pinned = sum(1 for e in self._visible.values() if e.pins)
            return {
                "path": self._path,
                "slot_bytes": self._slot_bytes,
                "slot_stride": self._slot_stride,
                "num_slots": self._num_slots,
                "capacity_bytes": self._capacity_bytes,
                "used_bytes": self._used_slots_locked() * self._slot_stride,
                "chunks": len(self._visible),
                "writing": len(self._writing),
                "pinned": pinned,
                "free_slots": len(self._free),
                "evictions": self._evictions,
                "integrity_failures": self._integrity_failures,
            }

    # ---- writes --------------------------------------------------------------------

    def begin_write(self, key: bytes) -> WriteReservation | None:
        """Reserve a slot for ``key``, evicting the LRU unpinned chunk if needed.

        Returns None when ``key`` is visible or already being written, or when
        every slot is pinned or reserved.
        """
        key = check_key(key)
        evicted: bytes | None = None
        with self._lock:
            self._check_open()
            self._reclaim_dropped_locked()
            if key in self._visible or key in self._writing:
                return None
            if self._free:
                slot = self._free.pop()
            else:
                evicted = self._evict_one_locked()
                if evicted is None:
                    return None
                slot = self._free.pop()
            self._writing[key] = slot
            self._update_gauges_locked()
        if evicted is not None:
            self._notify(evicted, False)
        start = slot * self._slot_stride
        return WriteReservation(self, key, slot, self._mv[start : start + self._slot_bytes])

    def _evict_one_locked(self) -> bytes | None:
        for key, entry in self._visible.items():
            if entry.pins == 0:
                del self._visible[key]
                self._free.append(entry.slot)
                self._evictions += 1
                if self._metrics is not None:
                    self._metrics.evictions.inc()
                return key
        return None

    def _finish_write(self, key: bytes, slot: int, checksum: int | None) -> bool:
        """Make ``key`` visible with ``checksum`` or, when None, free its slot."""
        with self._lock:
            if self._writing.get(key) != slot:
                return False
            del self._writing[key]
            if self._closed:
                return False
            if checksum is None:
                self._free.append(slot)
                self._update_gauges_locked()
                return False
            self._visible[key] = _Entry(slot=slot, checksum=checksum)
            self._update_gauges_locked()
        self._notify(key, True)
        return True

    def count_integrity_failure(self) -> None:
        """Count one received chunk that failed its checksum."""
        with self._lock:
            self._integrity_failures += 1
        if self._metrics is not None:
            self._metrics.integrity_failures.inc()

    # ---- reads ---------------------------------------------------------------------

    def pin(self, key: bytes) -> PinnedChunk | None:
        """Pin the visible chunk ``key`` so it is neither evicted nor overwritten.

        Returns None when ``key`` is not visible. Marks it recently used.
        """
        key = check_key(key)
        with self._lock:
            self._check_open()
            self._reclaim_dropped_locked()
            entry = self._visible.get(key)
            if entry is None:
                return None
            entry.pins += 1
            self._visible.move_to_end(key)
            slot, checksum = entry.slot, entry.checksum
        start = slot * self._slot_stride
        return PinnedChunk(self, key, slot, checksum, self._mv[start : start + self._slot_bytes])

    def _unpin(self, key: bytes) -> None:
        with self._lock:
            entry = self._visible.get(key)
            if entry is None or entry.pins == 0:
                return
            entry.pins -= 1
            if entry.pins or not entry.transient:
                return
            self._forget_locked(key, entry)
            self._update_gauges_locked()
        self._notify(key, False)

    def _dropped_handle(self, kind: str, key: bytes, slot: int) -> None:
        """Called from ``__del__`` of an unfinished handle: lock-free, reclaimed later."""
        self._dropped.append((kind, key, slot))

    def _reclaim_dropped_locked(self) -> None:
        if not self._dropped:  # the usual case: nothing to reclaim, the gauges are current
            return
        while self._dropped:
            kind, key, slot = self._dropped.popleft()
            if kind == "write" and self._writing.get(key) == slot:
                del self._writing[key]
                self._free.append(slot)
                log.warning("chunk store: a write reservation (slot %d) was dropped without "
                            "commit or abort; its slot is free again", slot)
            elif kind == "pin":
                entry = self._visible.get(key)
                if entry is not None and entry.slot == slot and entry.pins > 0:
                    entry.pins -= 1
                    log.warning("chunk store: a pin (slot %d) was dropped without release; "
                                "the chunk is evictable again", slot)
        self._update_gauges_locked()

    # ---- lifecycle -----------------------------------------------------------------

    def close(self, unlink: bool = True) -> None:
        """Forget every chunk, unmap the slots and (by default) unlink the file.

        Idempotent. Views still held by callers keep the mapping alive until
        they are released; the file name is gone at once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._visible.clear()
            self._writing.clear()
            self._free.clear()
            self._dropped.clear()
        if unlink:
            self._unlinker()
        else:
            self._unlinker.detach()
        unmap(self._mm, self._mv, f"chunk store {self._path}")

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ChunkStore(path={self._path!r}, slot_bytes={self._slot_bytes}, "
            f"num_slots={self._num_slots}, closed={self._closed})"
        )

    # ---- internals -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"chunk store {self._path} is closed")

    def _used_slots_locked(self) -> int:
        return len(self._visible) + len(self._writing)

    def _update_gauges_locked(self) -> None:
        if self._metrics is not None:
            self._metrics.store_used_bytes.set(self._used_slots_locked() * self._slot_stride)
            self._metrics.store_chunks.set(len(self._visible))

    def _notify(self, key: bytes, present: bool) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(key, present)
        except Exception:
            log.exception("chunk store on_change callback failed for a %s", "add" if present else "removal")
