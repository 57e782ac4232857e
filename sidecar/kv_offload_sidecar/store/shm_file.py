"""The store's shared-memory file: created once, preallocated, mapped shared and pre-faulted."""

from __future__ import annotations

import errno
import mmap
import os
import sys


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


def create_mapping(path: str, size: int, replace_existing: bool) -> mmap.mmap:
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
