"""chunk_checksum: XXH3-64 over any contiguous buffer, read in place."""

from __future__ import annotations

import mmap
import tracemalloc

import numpy as np
import pytest
from kv_offload_sidecar.store.checksum import chunk_checksum


def test_checksum_matches_published_xxh3_64_vectors() -> None:
    assert chunk_checksum(b"") == 0x2D06800538D394C2
    assert chunk_checksum(b"a") == 0xE6C632B61E964E1F


def test_checksum_is_the_same_for_every_buffer_type_over_equal_bytes() -> None:
    data = bytes(range(256)) * 1000
    with mmap.mmap(-1, len(data) + 100) as mm:
        mm[100:] = data
        views = [
            data,
            bytearray(data),
            memoryview(data),
            memoryview(mm)[100:],
            np.frombuffer(data, dtype=np.uint8),
            np.frombuffer(data, dtype=np.float32),
        ]
        digests = {chunk_checksum(v) for v in views}
        for v in views:
            if isinstance(v, memoryview):
                v.release()
    assert len(digests) == 1
    assert 0 <= digests.pop() < 2**64


def test_checksum_changes_when_one_bit_flips() -> None:
    data = bytearray(1 << 16)
    before = chunk_checksum(data)
    data[12345] ^= 0x10
    assert chunk_checksum(data) != before


def test_checksum_reads_a_large_shared_memory_view_without_copying_it() -> None:
    size = 32 << 20
    with mmap.mmap(-1, size) as mm:
        view = memoryview(mm)
        view[:8] = b"kvchunk!"
        tracemalloc.start()
        try:
            chunk_checksum(view)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        view.release()
    assert peak < (1 << 20), f"hashing allocated {peak} bytes: the buffer was copied"


@pytest.mark.parametrize(
    "bad",
    ["text", 42, np.arange(16, dtype=np.uint8)[::2], memoryview(bytes(16))[::2]],
    ids=["str", "int", "strided-ndarray", "strided-memoryview"],
)
def test_checksum_rejects_non_buffers_and_strided_buffers_naming_the_type(bad: object) -> None:
    with pytest.raises(TypeError, match=type(bad).__name__):
        chunk_checksum(bad)  # type: ignore[arg-type]
