"""vLLM's primary rows for tests: a memfd-backed region, as vLLM's SharedOffloadRegion maps /dev/shm."""

from __future__ import annotations

import mmap
import os

import numpy as np
from kv_offload_sidecar.engine.client import RowRegion
from kv_offload_sidecar.engine.region_file import find_region_file


class PrimaryRows:
    """``rows`` rows of ``stride`` bytes, a chunk of ``chunk_bytes`` at the start of each and guard
    bytes (0xEE) everywhere else; ``spec`` hands the region to an EngineClient."""

    def __init__(self, name: str = "rows", *, rows: int, stride: int, chunk_bytes: int) -> None:
        fd = os.memfd_create(f"kv-offload-test-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, rows * stride)
        self.map = mmap.mmap(fd, rows * stride)
        os.close(fd)
        self.chunk_bytes = chunk_bytes
        self.rows = np.frombuffer(self.map, dtype=np.uint8).reshape(rows, stride)
        self.rows[:] = 0xEE  # guard bytes everywhere
        found, reason = find_region_file(memoryview(self.map))
        assert found is not None, reason
        self.spec = RowRegion(found, stride, rows, chunk_bytes)

    def fill(self, row: int) -> bytes:
        """Random bytes written as ``row``'s chunk, returned."""
        data = os.urandom(self.chunk_bytes)
        self.rows[row, :self.chunk_bytes] = np.frombuffer(data, dtype=np.uint8)
        return data

    def chunk(self, row: int) -> bytes:
        return self.rows[row, :self.chunk_bytes].tobytes()
