"""vLLM's primary region as the sidecar maps it: rows the sidecar copies chunks into and out of.

The tier inside vLLM hands over the descriptor of the file behind its primary
region (``engine.region_file``) with the geometry vLLM gave it: ``num_rows``
rows of ``row_stride`` bytes starting at byte ``offset`` of the file, of which
the first ``chunk_bytes`` of a row hold one chunk. The sidecar maps exactly
those rows ``MAP_SHARED`` and from then on does the copies a store or load job
names, so vLLM's engine process moves no KV bytes.

Bounds: a row index outside ``[0, num_rows)`` is refused before any byte moves,
and a copy touches only the first ``chunk_bytes`` of the rows a job names, so
nothing of vLLM's memory is written outside them. The file must be at least as
large as the rows claim (checked with ``fstat``), so a short file cannot fault
the sidecar.

Copies run on ``RowCopier``'s own threads with ``numpy.copyto`` (the GIL is
released for the bytes), never on the sidecar's event loop: loads and stores on
threads of their own, so a load never waits behind a store's copies. A store
vLLM asks to be paced (it has no other store waiting) copies at most
``STORE_COPY_SHARE`` of the time, in the first half of its window to the
deadline; after that it copies flat out. A new region's
pages are faulted in on another thread (``RowCopier.prefault``), so the first
copy jobs do not queue behind it; a copy that reaches a page first faults it
in itself (the pre-fault changes no byte, so the order does not matter).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES, chunk_hasher

# Largest region the sidecar maps (bytes): a bound on what a local client can make it map.
MAX_REGION_BYTES = 1 << 42
# madvise(MADV_POPULATE_WRITE) (Linux 5.14): fault pages in writable without changing a byte.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Bytes a load copies between two looks at its deadline (so a late copy stops within one piece).
# Each piece is one GIL-free call; between pieces the copy thread must take the GIL back
# (kv_offload_sidecar.bulk_copies), so pieces are as large as a chunk usually is: 32 MiB
# take 3-10 ms here, far inside the 2 s a client waits past a deadline.
COPY_PIECE_BYTES = 32 << 20
# Bytes pre-faulted at a time (a closing region waits for at most one such piece).
PREFAULT_PIECE_BYTES = 64 << 20
# Share of the time a paced store's copy thread spends copying (it pauses between pieces
# for the rest). A store is background work, and where cores share one memory bus a copy
# at full speed slows the engine's decoding: by about 45 % on the 2-core host it was
# measured on. There, in two ``bench vllm`` runs back to back (tcp, 512 MiB), the decoding
# request's inter-token p99 while a prefix was stored was 1.87x quiet at full speed and
# 1.06x with the store's copies paced to 1 GB/s, about a sixth of their rate.
STORE_COPY_SHARE = 1 / 6


class RegionError(ValueError):
    """A region or row request that does not fit the rows the tier handed over."""


class EngineRegion:
    """The rows of one engine's primary region, mapped from its file descriptor."""

    def __init__(self, fd: int, *, offset: int, row_stride: int, num_rows: int,
                 chunk_bytes: int) -> None:
        for name, value in (("offset", offset), ("row_stride", row_stride),
                            ("num_rows", num_rows), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RegionError(f"region {name} must be a non-negative integer, got {value!r}")
        if not 0 < chunk_bytes <= row_stride or num_rows <= 0:
            raise RegionError(f"region rows of {row_stride} bytes cannot hold chunks of "
                              f"{chunk_bytes} bytes (num_rows {num_rows})")
        size = row_stride * num_rows
        if size > MAX_REGION_BYTES:
            raise RegionError(f"region of {size} bytes exceeds {MAX_REGION_BYTES}")
        try:
            file_size = os.fstat(fd).st_size
        except OSError as exc:
            raise RegionError(f"region descriptor: {exc.strerror}") from None
        if offset + size > file_size:
            raise RegionError(f"region rows end at byte {offset + size} but its file has "
                              f"{file_size} bytes")
        page_offset = offset - offset % mmap.ALLOCATIONGRANULARITY
        self._skip = offset - page_offset
        try:
            self._mm = mmap.mmap(fd, self._skip + size, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=page_offset)
        except (OSError, ValueError) as exc:
            raise RegionError(f"cannot map the region: {exc}") from None
        self.row_stride = row_stride
        self.num_rows = num_rows
        self.chunk_bytes = chunk_bytes
        self._rows = np.frombuffer(self._mm, dtype=np.uint8, count=size,
                                   offset=self._skip).reshape(num_rows, row_stride)
        self._size = size
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False

    def prefault(self) -> bool:
        """Map every page of the rows writable now (``MADV_POPULATE_WRITE`` keeps their bytes),
        so later copies take no page faults, in pieces of ``PREFAULT_PIECE_BYTES`` each holding
        the region like a job; False where the kernel lacks it (then the pages fault in on
        first use) or once the region is closing."""
        total = self._skip + self._size
        for start in range(0, total, PREFAULT_PIECE_BYTES):
            if not self.acquire():
                return False
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE, start, min(PREFAULT_PIECE_BYTES, total - start))
            except (OSError, ValueError, AttributeError):
                return False
            finally:
                self.release()
        return True

    def check_rows(self, rows: Sequence[object], count: int) -> list[int]:
        """The first ``count`` row indices of a request, each within the region (else RegionError)."""
        if not isinstance(rows, list) or len(rows) < count:
            raise RegionError(f"'rows' must list one row per key ({count})")
        out = []
        for i, r in enumerate(rows[:count]):
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.num_rows:
                raise RegionError(f"rows[{i}] = {r!r} is not a row of this region "
                                  f"(0..{self.num_rows - 1})")
            out.append(r)
        return out

    def row(self, index: int) -> np.ndarray:
        """The chunk bytes of row ``index`` (a view; valid while the region is in use)."""
        return self._rows[index, :self.chunk_bytes]

    def acquire(self) -> bool:
        """Take the region for one job; False once it is closing."""
        with self._lock:
            if self._closing:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._closing and self._users == 0
        if last:
            self._unmap()

    def close(self) -> None:
        """Unmap now, or when the last job using the region ends."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._users == 0
        if idle:
            self._unmap()

    @property
    def closed(self) -> bool:
        return self._closing

    def _unmap(self) -> None:
        self._rows = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view outlived its job; the mapping goes with the last one
            pass


def _as_array(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


class JobDeadline:
    """When a row job must stop touching rows: its deadline or a cancel, whichever comes first.

    Set on the event loop, read by the copy thread before each piece (a bool and a float:
    no lock needed)."""

    def __init__(self, at: float) -> None:
        # The job's deadline, a time.monotonic() value.
        self.at = at
        # When the job came in (time.monotonic()).
        self.opened = time.monotonic()
        # True once the engine cancelled the job.
        self.cancelled = False

    def in_first_half(self) -> bool:
        """Whether less than half the time between the job's arrival and its deadline went."""
        return time.monotonic() < (self.opened + self.at) / 2

    def cancel(self) -> None:
        self.cancelled = True

    def expired(self) -> bool:
        return self.cancelled or time.monotonic() > self.at


class RowCopier:
    """Threads that copy chunk bytes between the store's slots and an engine's rows, one
    chunk per task: ``threads`` (``bulk_copies.copy_threads()``: one core's memcpy is the
    bound of a hit in the pod's own sidecar) for loads and as many for stores.

    Deadlines are ``time.monotonic()`` values (CLOCK_MONOTONIC, one clock for
    every container of a pod): the engine gives up on a job at its deadline and
    may then reuse its rows, so a store commits only chunks copied by then and a
    load starts no piece of a copy after it; a cancelled job (``JobDeadline.cancel``)
    stops the same way at its next piece.
    """

    def __init__(self, threads: int = 1) -> None:
        self._loads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-offload-load-rows")
        self._stores = ThreadPoolExecutor(max_workers=threads,
                                          thread_name_prefix="kv-offload-store-rows")
        self._prefaults = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload-prefault")

    def store(self, region: EngineRegion, row: int, slot: memoryview, deadline: JobDeadline,
              paced: bool = False) -> Future[int | None]:
        """``row_to_slot`` on a store thread."""
        return self._stores.submit(self.row_to_slot, region, row, slot, deadline, paced)

    def load(self, region: EngineRegion, slot: memoryview, row: int,
             deadline: JobDeadline) -> Future[bool]:
        """``slot_to_row`` on a load thread."""
        return self._loads.submit(self.slot_to_row, region, slot, row, deadline)

    @staticmethod
    def row_to_slot(region: EngineRegion, row: int, slot: memoryview, deadline: JobDeadline,
                    paced: bool = False) -> int | None:
        """Copy one row into its slot; the slot's checksum, or None when ``deadline`` expired
        (or the job was cancelled) before the copy ended: no piece of the row is read after
        that, and the caller aborts the chunk.

        Copied and hashed ``CACHED_PIECE_BYTES`` at a time, each piece hashed from the row
        right after its copy read it into the cache (the copy's stores bypass the cache):
        one pass over memory fewer than hashing the slot afterwards. Should the row change
        between the two, the checksum is not the slot's, and every later read of the chunk
        fails its verification. ``paced``: after each piece, pause so that copying takes
        ``STORE_COPY_SHARE`` of the time, while the job is in the first half of its window."""
        n = region.chunk_bytes
        src, dst = region.row(row), _as_array(slot)
        hasher = chunk_hasher()
        pause = 1 / STORE_COPY_SHARE - 1
        for start in range(0, n, CACHED_PIECE_BYTES):
            if deadline.expired():
                return None
            end = min(n, start + CACHED_PIECE_BYTES)
            began = time.perf_counter()
            np.copyto(dst[start:end], src[start:end])
            hasher.update(src[start:end])
            if paced and deadline.in_first_half():
                time.sleep((time.perf_counter() - began) * pause)
        if n < len(slot):  # bytes of the slot past the chunk count as the store hashes them
            hasher.update(dst[n:])
        return None if deadline.expired() else hasher.intdigest()

    @staticmethod
    def slot_to_row(region: EngineRegion, slot: memoryview, row: int,
                    deadline: JobDeadline) -> bool:
        """Copy one pinned slot into its row in pieces of at most ``COPY_PIECE_BYTES``, none
        started once ``deadline`` expired; True when the row got the whole chunk."""
        n = region.chunk_bytes
        src, dst = _as_array(slot), region.row(row)
        for start in range(0, n, COPY_PIECE_BYTES):
            if deadline.expired():
                return False
            end = min(n, start + COPY_PIECE_BYTES)
            np.copyto(dst[start:end], src[start:end])
        return True

    def prefault(self, region: EngineRegion) -> Future[bool]:
        """``region.prefault()`` on a thread of its own, beside the copies (not before them)."""
        return self._prefaults.submit(region.prefault)

    def close(self) -> None:
        self._prefaults.shutdown(wait=True)  # a closed region's pre-fault ends at its next piece
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)


__all__ = ["COPY_PIECE_BYTES", "EngineRegion", "JobDeadline", "MAX_REGION_BYTES",
           "PREFAULT_PIECE_BYTES", "RegionError", "RowCopier", "STORE_COPY_SHARE"]
