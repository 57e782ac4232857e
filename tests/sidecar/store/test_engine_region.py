"""EngineRegion and RowCopier in the sidecar's process: pre-faulting keeps every byte and
gives way to a close, a cancelled job touches no row, and a stored row's checksum is
its slot's."""

import contextlib
import mmap
import os
import time
from collections.abc import Iterator

import numpy as np
from waiting import wait_for
from kv_offload_sidecar.store.engine_region import (
    PREFAULT_PIECE_BYTES,
    EngineRegion,
    JobDeadline,
    RowCopier,
)

CHUNK = 16384
STRIDE = CHUNK + mmap.PAGESIZE


def _region_file(rows: int, stride: int = STRIDE) -> tuple[int, mmap.mmap]:
    """A memfd of ``rows`` rows of random bytes (the engine's side of the region)."""
    fd = os.memfd_create("kv-offload-test-region", os.MFD_CLOEXEC)
    os.ftruncate(fd, rows * stride)
    engine = mmap.mmap(fd, rows * stride)
    engine[:] = os.urandom(rows * stride)
    return fd, engine


@contextlib.contextmanager
def _copying(rows: int, stride: int = STRIDE,
             chunk: int = CHUNK) -> Iterator[tuple[mmap.mmap, EngineRegion, RowCopier]]:
    """A region of ``rows`` random rows (the engine's mapping, the sidecar's region) and a
    copier, all closed afterwards."""
    fd, engine = _region_file(rows, stride)
    region = EngineRegion(fd, offset=0, row_stride=stride, num_rows=rows, chunk_bytes=chunk)
    copier = RowCopier()  # one copy thread for loads, one for stores
    try:
        yield engine, region, copier
    finally:
        copier.close()
        region.close()
        engine.close()
        os.close(fd)


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def test_prefault_in_pieces_keeps_every_byte_of_the_rows():
    rows = PREFAULT_PIECE_BYTES // STRIDE + 3  # more than one piece
    fd, engine = _region_file(rows)
    region = EngineRegion(fd, offset=0, row_stride=STRIDE, num_rows=rows, chunk_bytes=CHUNK)
    try:
        before = engine[:]
        copier = RowCopier()
        try:
            # False only on a kernel without MADV_POPULATE_WRITE (before Linux 5.14).
            assert copier.prefault(region).result() is (_kernel() >= (5, 14))
        finally:
            copier.close()
        assert engine[:] == before
        assert not region.closed
    finally:
        region.close()
        engine.close()
        os.close(fd)


def test_prefault_of_a_closing_region_stops_and_the_region_unmaps_after_its_last_job():
    fd, engine = _region_file(4)
    region = EngineRegion(fd, offset=0, row_stride=STRIDE, num_rows=4, chunk_bytes=CHUNK)
    try:
        assert region.acquire()  # a job in flight
        region.close()
        assert region.prefault() is False
        assert region.row(1).nbytes == CHUNK  # still mapped for the job
        region.release()
        assert region.closed
    finally:
        engine.close()
        os.close(fd)


def test_a_cancelled_job_copies_nothing_either_way():
    with _copying(4) as (engine, region, copier):
        slot = memoryview(bytearray(b"\x5a" * CHUNK))
        before = engine[:]
        deadline = JobDeadline(time.monotonic() + 600)
        deadline.cancel()
        assert deadline.expired()
        assert copier.load(region, slot, 2, deadline).result() is False
        assert copier.store(region, 1, slot, deadline).result() is None
        assert engine[:] == before and bytes(slot) == b"\x5a" * CHUNK
        # The same job not cancelled copies.
        live = JobDeadline(time.monotonic() + 600)
        assert copier.load(region, slot, 2, live).result() is True
        assert np.frombuffer(engine, np.uint8)[2 * STRIDE:2 * STRIDE + CHUNK].tobytes() == \
            b"\x5a" * CHUNK


def test_a_stored_rows_checksum_is_its_slots_over_several_cache_pieces():
    from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES, chunk_checksum

    chunk = 2 * CACHED_PIECE_BYTES + 4096  # pieces, and a last one shorter than a piece
    stride = chunk + mmap.PAGESIZE
    with _copying(2, stride, chunk) as (engine, region, copier):
        # A slot as long as the chunk, and longer; copied flat out and paced.
        for slot_bytes, paced in ((chunk, False), (chunk + 512, False), (chunk, True)):
            slot = memoryview(bytearray(b"\x33" * slot_bytes))
            checksum = copier.store(region, 1, slot, JobDeadline(time.monotonic() + 600),
                                    paced).result()
            assert bytes(slot[:chunk]) == engine[stride:stride + chunk]
            assert checksum == chunk_checksum(slot)


def test_a_load_is_copied_while_a_paced_store_is_still_copying():
    from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES

    chunk = 32 * CACHED_PIECE_BYTES  # a paced store of 32 pieces, pausing after each
    with _copying(2, chunk, chunk) as (_engine, region, copier):
        deadline = JobDeadline(time.monotonic() + 600)
        stored = copier.store(region, 0, memoryview(bytearray(chunk)), deadline, True)
        loaded = copier.load(region, memoryview(bytearray(b"\x77" * chunk)), 1, deadline)
        assert loaded.result() is True
        assert not stored.done()  # the load did not wait behind the store's copies
        assert stored.result() is not None


def test_a_store_cancelled_mid_copy_reads_no_further_piece_of_its_row():
    from kv_offload_sidecar.store.checksum import CACHED_PIECE_BYTES

    chunk = 64 * CACHED_PIECE_BYTES  # a paced store of 64 pieces, pausing after each
    with _copying(1, chunk, chunk) as (engine, region, copier):
        engine[:] = b"\x11" * chunk  # a byte the empty slot does not hold
        slot = memoryview(bytearray(chunk))
        deadline = JobDeadline(time.monotonic() + 600)
        stored = copier.store(region, 0, slot, deadline, True)
        wait_for("the store's first piece copied", lambda: slot[0] == 0x11, interval=0.001)
        deadline.cancel()  # what drain_jobs' cancel does
        assert stored.result() is None  # not committed
        assert bytes(slot[-CACHED_PIECE_BYTES:]) == bytes(CACHED_PIECE_BYTES)  # never copied


def test_a_job_is_in_the_first_half_of_its_window_until_half_its_time_went():
    assert JobDeadline(time.monotonic() + 600).in_first_half()
    assert not JobDeadline(time.monotonic() - 1).in_first_half()  # deadline already past
