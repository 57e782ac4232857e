"""The engine side's mapping of the sidecar's store file (standard library only).

The sidecar's ``ChunkStore`` keeps its slots in one shared-memory file; the
tier inside vLLM maps the same file and copies chunk bytes straight into or
out of slots that the sidecar reserved or pinned for it over the local channel.
The slot geometry (``slot_stride_for``) and the unmapping (``unmap``) are defined
here, once, for both sides.
"""

from __future__ import annotations

import logging
import mmap
import os

log = logging.getLogger(__name__)


def slot_stride_for(slot_bytes: int) -> int:
    """Bytes between slot starts: ``slot_bytes`` rounded up to the page size."""
    page = mmap.PAGESIZE
    return -(-slot_bytes // page) * page


def unmap(mm: mmap.mmap, mv: memoryview, name: str) -> None:
    """Release ``mv`` (the view of ``mm``) and close ``mm``; while views of it are still
    exported the mapping stays, and goes when the last of them is freed."""
    mv.release()
    try:
        mm.close()
    except BufferError:
        log.debug("%s: views still exported; unmapped when they are freed", name)


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
        unmap(self._mm, self._mv, f"chunk store view {self.path}")

    def __enter__(self) -> ChunkStoreView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
