"""The store's shared-memory file: created once, preallocated, mapped shared and pre-faulted.

A restarted sidecar (crash, OOM kill, liveness probe) finds its previous store file
at the same path. It never reuses it: it unlinks it and creates a new file (a new
inode), so a vLLM tier that still maps the old file (and may still be copying into
slots the dead sidecar handed out) can never touch a byte of the new store. The old
file's pages stay allocated until the last mapping of it goes, and the pod's
``/dev/shm`` holds one store, not two; so when the preallocation finds no room and
the leftover file's pages would make room, ``create_mapping`` waits (at most
``RECLAIM_WAIT_SECONDS``, logging progress) for the tier to let go of the old
mapping, which it does as soon as its dead sidecar's local channel closes
(``engine.sidecar_attachment``). Past that wait, or when even the leftover's pages
would not make room, it raises ``ValueError`` naming the sizes.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import time

log = logging.getLogger(__name__)

# Seconds a restarted sidecar waits for its previous store file's pages to be freed (the
# tier unmaps it once the old sidecar's channel closes) before it gives up on the space.
RECLAIM_WAIT_SECONDS = 30.0
# Seconds between two checks of the free space while waiting.
RECLAIM_POLL_SECONDS = 0.05
# Seconds between two progress lines while waiting.
RECLAIM_LOG_SECONDS = 2.0


def store_file_path(directory: str, name: str) -> str:
    """Path of the shared-memory file of the store called ``name``."""
    return os.path.join(directory, f"kv-offload-{name}.slots")


def unlink_quietly(path: str) -> None:
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


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _allocated_bytes(path: str) -> int:
    """Bytes ``path`` holds in its file system (0: no such file)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _reserve(fd: int, path: str, size: int, leftover: int) -> None:
    """Preallocate ``size`` bytes of ``fd``; on ENOSPC wait for the ``leftover`` bytes of
    the unlinked previous store to be freed (see the module docstring), else raise."""
    directory = os.path.dirname(path)
    deadline = time.monotonic() + RECLAIM_WAIT_SECONDS
    next_log = 0.0
    while True:
        try:
            # Reserve the pages now: a full tmpfs fails here, not with SIGBUS later.
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return
            if exc.errno != errno.ENOSPC:
                raise
            failure = exc
        while True:  # until the space is there (then preallocate again), or give up
            free = _free_bytes(directory)
            now = time.monotonic()
            if free + leftover < size or now >= deadline:
                waited = (f" after waiting {RECLAIM_WAIT_SECONDS:.0f} s for the previous store file's "
                          f"{leftover} bytes to be let go (another process still maps it: a vLLM tier "
                          "older than this sidecar lets go only when it re-attaches)"
                          if leftover and free + leftover >= size else "")
                raise ValueError(
                    f"capacity_bytes needs {size} bytes in {directory!r} but only {free} are free"
                    f"{waited}; lower capacity_bytes or enlarge the shared-memory volume"
                ) from failure
            if free < size and now >= next_log:
                log.warning("store %s: waiting for vLLM's tier to let go of the previous store file "
                            "(%d bytes, unlinked): %d of %d bytes free, giving up in %.0f s",
                            path, leftover, free, size, deadline - now)
                next_log = now + RECLAIM_LOG_SECONDS
            time.sleep(RECLAIM_POLL_SECONDS)
            if free >= size:
                break


def create_mapping(path: str, size: int, replace_existing: bool) -> mmap.mmap:
    """Create ``path`` (O_EXCL, 0600), preallocate ``size`` bytes, map it shared and pre-fault it.

    ``replace_existing`` unlinks a file left at ``path`` first and, when the space is
    short, waits for its pages to be freed (module docstring).
    """
    leftover = 0
    if replace_existing:
        leftover = _allocated_bytes(path)
        unlink_quietly(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"chunk store file {path!r} already exists (another sidecar, or a crashed one); "
            "pick another store name or pass replace_existing=True"
        ) from None
    try:
        os.ftruncate(fd, size)
        _reserve(fd, path, size, leftover)
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
