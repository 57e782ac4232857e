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

This module imports only the standard library at import time (``xxhash`` is
loaded when a ``ChunkStore`` is built) so ``ChunkStoreView`` can be used
inside vLLM's process.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import sys
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Longest key accepted (bytes); vLLM's OffloadKey is 36 (32-byte hash + u32 group).
MAX_KEY_BYTES = 4096
DEFAULT_SHM_DIRECTORY = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

OnChange = Callable[[bytes, bool], None]


def slot_stride_for(slot_bytes: int) -> int:
    """Bytes between slot starts: ``slot_bytes`` rounded up to the page size."""
    page = mmap.PAGESIZE
    return -(-slot_bytes // page) * page


def store_file_path(directory: str, name: str) -> str:
    """Path of the shared-memory file of the store called ``name``."""
    return os.path.join(directory, f"kv-offload-{name}.slots")


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"chunk key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(
            f"chunk key length {len(key)} is out of range; keys are 1..{MAX_KEY_BYTES} bytes"
        )
    return key


def _checked_keys(keys: Iterable[bytes]) -> list[bytes] | tuple[bytes, ...]:
    """``keys`` as a sequence of valid keys, checked in one pass of C-level loops.

    The common case (a list of ``bytes`` of allowed lengths) is returned as is;
    anything else goes through ``_check_key`` per key (copies views, raises the
    error naming the bad key).
    """
    seq = keys if type(keys) is list or type(keys) is tuple else list(keys)
    if not seq:
        return seq
    if set(map(type, seq)) == {bytes}:
        lengths = list(map(len, seq))
        if min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES:
            return seq
    return [_check_key(k) for k in seq]


@dataclass
class _Entry:
    # Slot index holding the chunk's bytes.
    slot: int
    # XXH3-64 of the chunk's slot_bytes.
    checksum: int
    # Number of live PinnedChunk handles; > 0 means never evicted.
    pins: int = 0


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
        restarted sidecar); otherwise an existing file is an error.
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
        from .checksum import chunk_checksum

        self._checksum = chunk_checksum
        self._slot_bytes = slot_bytes
        self._slot_stride = stride
        self._capacity_bytes = capacity_bytes
        self._num_slots = capacity_bytes // stride
        self._path = store_file_path(directory, name)
        self._metrics = metrics
        self._on_change = on_change
        self._mm = _create_mapping(self._path, self._num_slots * stride, replace_existing)
        self._mv = memoryview(self._mm)
        # Unlinks the file if the store is garbage-collected or the process exits unclosed.
        self._unlinker = weakref.finalize(self, _unlink_quietly, self._path)

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
        key = _check_key(key)
        with self._lock:
            return key in self._visible

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES and self.contains(key)

    def lookup_prefix(self, keys: Iterable[bytes]) -> int:
        """Number of leading ``keys`` that are visible; marks them recently used.

        The prefix is touched back to front so its first chunk is the most
        recently used: eviction takes the tail of a prefix before its head.
        """
        checked = _checked_keys(keys)
        with self._lock:
            self._check_open()
            self._reclaim_dropped_locked()
            visible = self._visible
            hits = 0
            for key in checked:
                if key not in visible:
                    break
                hits += 1
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
        checked = _checked_keys(keys)
        moved = 0
        with self._lock:
            self._check_open()
            for key in checked:
                if key in self._visible:
                    self._visible.move_to_end(key, last=False)
                    moved += 1
        return moved

    def checksum_of(self, key: bytes) -> int | None:
        """Checksum of the visible chunk ``key``, or None when it is not visible."""
        key = _check_key(key)
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
        key = _check_key(key)
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

    def _count_integrity_failure(self) -> None:
        with self._lock:
            self._integrity_failures += 1
        if self._metrics is not None:
            self._metrics.integrity_failures.inc()

    # ---- reads ---------------------------------------------------------------------

    def pin(self, key: bytes) -> PinnedChunk | None:
        """Pin the visible chunk ``key`` so it is neither evicted nor overwritten.

        Returns None when ``key`` is not visible. Marks it recently used.
        """
        key = _check_key(key)
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
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def _dropped_handle(self, kind: str, key: bytes, slot: int) -> None:
        """Called from ``__del__`` of an unfinished handle: lock-free, reclaimed later."""
        self._dropped.append((kind, key, slot))

    def _reclaim_dropped_locked(self) -> None:
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
        self._mv.release()
        try:
            self._mm.close()
        except BufferError:
            log.debug("chunk store %s: views still exported; unmapped when they are freed", self._path)

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


class WriteReservation:
    """A slot reserved for one key; the chunk becomes visible only at ``commit``.

    Write (or ``recv_into``) the chunk's ``slot_bytes`` into ``view`` and call
    ``commit(expected_checksum)``. ``abort()`` frees the slot. As a context
    manager, leaving without commit aborts. After commit/abort ``view`` is
    released and raises on use.
    """

    def __init__(self, store: ChunkStore, key: bytes, slot: int, view: memoryview) -> None:
        self._store = store
        self.key = key
        # Slot index in the store file.
        self.slot = slot
        # Writable view of exactly slot_bytes.
        self.view = view
        self._done = False

    def commit(self, expected_checksum: int | None = None) -> bool:
        """Checksum the slot and make the chunk visible.

        With ``expected_checksum`` (a received chunk) a mismatch counts an
        integrity failure, frees the slot and returns False. Returns False too
        when the reservation already ended or the store closed.
        """
        if self._done:
            return False
        self._done = True
        try:
            checksum = self._store._checksum(self.view)
        except TypeError:  # the caller released the view: nothing trustworthy to publish
            self._store._finish_write(self.key, self.slot, None)
            return False
        if expected_checksum is not None and checksum != expected_checksum:
            self._store._count_integrity_failure()
            self._store._finish_write(self.key, self.slot, None)
            self._release_view()
            return False
        ok = self._store._finish_write(self.key, self.slot, checksum)
        self._release_view()
        return ok

    def abort(self) -> None:
        """Free the slot; the key stays invisible. Idempotent."""
        if self._done:
            return
        self._done = True
        self._store._finish_write(self.key, self.slot, None)
        self._release_view()

    @property
    def done(self) -> bool:
        return self._done

    def __del__(self) -> None:
        # A reservation lost by its caller must not hold its slot forever.
        if not getattr(self, "_done", True):
            self._store._dropped_handle("write", self.key, self.slot)

    def _release_view(self) -> None:
        try:
            self.view.release()
        except BufferError:  # the caller still holds a derived buffer
            pass

    def __enter__(self) -> WriteReservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class PinnedChunk:
    """A visible chunk held in place while it is sent or read.

    ``view`` is the slot's bytes (treat as read-only); ``release()`` (or leaving
    the ``with`` block) drops the pin and releases ``view``.
    """

    def __init__(
        self, store: ChunkStore, key: bytes, slot: int, checksum: int, view: memoryview
    ) -> None:
        self._store = store
        self.key = key
        # Slot index in the store file.
        self.slot = slot
        # XXH3-64 of the chunk, computed or verified at commit.
        self.checksum = checksum
        # View of exactly slot_bytes.
        self.view = view
        self._released = False

    def release(self) -> None:
        """Drop the pin. Idempotent."""
        if self._released:
            return
        self._released = True
        self._store._unpin(self.key)
        try:
            self.view.release()
        except BufferError:
            pass

    def __del__(self) -> None:
        # A pin lost by its caller must not keep its chunk unevictable forever.
        if not getattr(self, "_released", True):
            self._store._dropped_handle("pin", self.key, self.slot)

    def __enter__(self) -> PinnedChunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ChunkStoreView:
    """The engine side's mapping of a store file: slot views, no bookkeeping.

    Standard library only. Which slot holds which chunk, and when a slot may be
    touched, is decided by the sidecar (reservations and pins) and passed to the
    engine client over the local channel.
    """

    def __init__(self, path: str, slot_bytes: int, num_slots: int, slot_stride: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.slot_stride = slot_stride
        size = num_slots * slot_stride
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(
                f"cannot open chunk store file {path!r}: {exc.strerror}; "
                "check the sidecar is running and shares this pod's /dev/shm"
            ) from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(
                    f"chunk store file {path!r} has {actual} bytes but num_slots={num_slots} "
                    f"x slot_stride={slot_stride} needs {size}; use the geometry the sidecar reports"
                )
            # MAP_POPULATE maps every (already allocated) page now, without touching a byte, so
            # the engine's first load or store into a slot takes no page faults.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._mv = memoryview(self._mm)

    @classmethod
    def attach(
        cls, path: str, slot_bytes: int, num_slots: int, slot_stride: int | None = None
    ) -> ChunkStoreView:
        """Map the existing store file at ``path`` read/write."""
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(f"slot_bytes={slot_bytes!r} must be a positive integer")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots={num_slots!r} must be a positive integer")
        stride = slot_stride_for(slot_bytes) if slot_stride is None else slot_stride
        if stride < slot_bytes or stride % mmap.PAGESIZE:
            raise ValueError(
                f"slot_stride={stride!r} must be a page multiple >= slot_bytes={slot_bytes}"
            )
        return cls(path, slot_bytes, num_slots, stride)

    def slot_view(self, slot: int) -> memoryview:
        """Writable view of exactly ``slot_bytes`` of slot ``slot``."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise IndexError(f"slot={slot!r} is out of range; the store has slots 0..{self.num_slots - 1}")
        start = slot * self.slot_stride
        return self._mv[start : start + self.slot_bytes]

    def close(self) -> None:
        """Unmap (the file belongs to the sidecar and is left in place)."""
        self._mv.release()
        try:
            self._mm.close()
        except BufferError:
            log.debug("chunk store view %s: views still exported", self.path)

    def __enter__(self) -> ChunkStoreView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# Linux 5.14+ madvise advice: fault every page in, writable (Python 3.11 lacks the constant).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _prefault(mm: mmap.mmap, size: int) -> str:
    """Map every page of ``mm`` writable now, so first writes into fresh slots take no page faults.

    Uses ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it, else writes
    one zero byte per page (the file is new, so its bytes are zeros already).
    Returns the method used ("madvise" or "touch").
    """
    if sys.platform.startswith("linux") and hasattr(mm, "madvise"):
        try:
            mm.madvise(MADV_POPULATE_WRITE, 0, size)
            return "madvise"
        except OSError:
            pass  # EINVAL before Linux 5.14: touch the pages instead
    for offset in range(0, size, mmap.PAGESIZE):
        mm[offset] = 0
    return "touch"


def _create_mapping(path: str, size: int, replace_existing: bool) -> mmap.mmap:
    """Create ``path`` (O_EXCL, 0600), preallocate ``size`` bytes, map it shared and pre-fault it."""
    if replace_existing:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"chunk store file {path!r} already exists (another sidecar, or a crashed one); "
            "pick another store name or pass replace_existing=True"
        ) from None
    try:
        os.ftruncate(fd, size)
        try:
            # Reserve the pages now: a full tmpfs fails here, not with SIGBUS later.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                free = os.statvfs(path)
                raise ValueError(
                    f"capacity_bytes needs {size} bytes in {os.path.dirname(path)!r} but only "
                    f"{free.f_bavail * free.f_frsize} are free; lower capacity_bytes or enlarge "
                    "the shared-memory volume"
                ) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _prefault(mm, size)
        return mm
    except BaseException:
        os.close(fd)
        fd = -1
        os.unlink(path)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
