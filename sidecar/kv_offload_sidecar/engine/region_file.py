"""The file behind vLLM's primary region, found from inside vLLM's process (standard library only).

vLLM's CPU primary tier is one ``MAP_SHARED`` mapping of a shared-memory file
(``SharedOffloadRegion``: ``/dev/shm/vllm_offload_{engine_id}.mmap``, which
keeps its descriptor open and may be unlinked). The tier hands that file to
its sidecar as a descriptor over the local channel (SCM_RIGHTS), so the sidecar
maps the same pages whatever its user or the path's fate, and copies chunks
into and out of vLLM's rows itself: vLLM's engine process moves no KV bytes.

``find_region_file(view)`` locates the mapping that holds ``view`` in
``/proc/self/maps`` and a descriptor of this process open on the same inode
(or, failing that, the path itself when it still names that inode). None (with
the reason) when the view is not file-backed, e.g. anonymous memory: the tier
then copies itself, with ``copy_released`` (``ctypes.memmove``, which releases
the GIL, so vLLM's scheduler thread keeps running during the copy).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RegionFile:
    """A descriptor of the file that backs a view, and where the view starts in it."""

    # Descriptor to send (owned: close it after sending when ``owned``).
    fd: int
    # Byte offset of the view's first byte within the file.
    offset: int
    # True when this module opened ``fd`` (the caller closes it); False: vLLM's own.
    owned: bool
    # The mapping's path as /proc/self/maps names it (for messages).
    path: str


def buffer_address(view: memoryview) -> int:
    """Address of a writable, C-contiguous buffer's first byte."""
    holder = (ctypes.c_char * 1).from_buffer(view)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def _mapping_of(address: int, maps_path: str) -> tuple[int, int, int, int, str] | None:
    """(start, file offset of start, device, inode, path) of the mapping holding ``address``."""
    with open(maps_path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            lo, _, hi = parts[0].partition("-")
            start, end = int(lo, 16), int(hi, 16)
            if not start <= address < end:
                continue
            major, _, minor = parts[3].partition(":")
            inode = int(parts[4])
            path = parts[5].strip() if len(parts) > 5 else ""
            if inode == 0:
                return None
            return start, int(parts[2], 16), os.makedev(int(major, 16), int(minor, 16)), inode, path
    return None


def find_region_file(view: memoryview, *, proc: str = "/proc/self") -> tuple[RegionFile | None, str]:
    """(the file behind ``view``, "") or (None, why not)."""
    try:
        address = buffer_address(view)
    except (TypeError, ValueError) as exc:
        return None, f"the primary view is not a writable contiguous buffer ({exc})"
    try:
        mapping = _mapping_of(address, f"{proc}/maps")
    except OSError as exc:
        return None, f"cannot read {proc}/maps ({exc.strerror})"
    if mapping is None:
        return None, "the primary region is anonymous memory, not a shared file"
    start, map_offset, device, inode, path = mapping
    offset = map_offset + (address - start)
    if not _same_mapping_to_end(address, view.nbytes, inode, proc):
        return None, "the primary view spans more than one file"
    fd_dir = f"{proc}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError as exc:
        names = []
        reason = f"cannot list {fd_dir} ({exc.strerror})"
    else:
        reason = f"no descriptor of this process is open on {path!r}"
    for name in names:
        try:
            st = os.stat(f"{fd_dir}/{name}")
        except OSError:
            continue
        if st.st_ino == inode and st.st_dev == device:
            return RegionFile(int(name), offset, False, path), ""
    plain = path.removesuffix(" (deleted)")
    try:
        fd = os.open(plain, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None, reason
    st = os.fstat(fd)
    if st.st_ino == inode and st.st_dev == device:
        return RegionFile(fd, offset, True, path), ""
    os.close(fd)
    return None, reason


def _same_mapping_to_end(address: int, nbytes: int, inode: int, proc: str) -> bool:
    """Whether the view's last byte lies in a mapping of the same inode (vLLM maps it whole)."""
    last = _mapping_of(address + max(nbytes, 1) - 1, f"{proc}/maps")
    return last is not None and last[3] == inode


def copy_released(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (same size) with ``ctypes.memmove``, which releases the GIL."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    src_holder = (ctypes.c_char * src.nbytes).from_buffer(src)  # both views are writable mappings
    dst_holder = (ctypes.c_char * dst.nbytes).from_buffer(dst)
    try:
        ctypes.memmove(dst_holder, src_holder, dst.nbytes)
    finally:
        del dst_holder, src_holder


__all__ = ["RegionFile", "buffer_address", "copy_released", "find_region_file"]
