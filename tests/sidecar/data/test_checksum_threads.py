"""Received chunks hashed on the process's checksum threads, not on the event loop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
from kv_offload_sidecar.cpu_budget import cpu_budget
from kv_offload_sidecar.data.checksum_threads import (THREAD_PREFIX, checksum_off_loop, checksum_threads)
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.settings import MAX_DATA_LANES
from kv_offload_sidecar.store.checksum import chunk_checksum


async def test_a_chunk_is_hashed_on_a_checksum_thread_to_the_same_digest() -> None:
    chunks = [os.urandom(OFF_LOOP_BYTES) + bytes([i]) for i in range(4)]
    digests = await asyncio.gather(*(checksum_off_loop(memoryview(c)) for c in chunks))
    assert digests == [chunk_checksum(c) for c in chunks]
    assert len(set(digests)) == 4
    assert any(t.name.startswith(THREAD_PREFIX) for t in threading.enumerate())
    assert not threading.current_thread().name.startswith(THREAD_PREFIX)


async def test_a_released_buffer_fails_the_hash_instead_of_reading_freed_memory() -> None:
    view = memoryview(bytearray(OFF_LOOP_BYTES))
    view.release()
    with pytest.raises(TypeError, match="C-contiguous bytes-like"):
        await checksum_off_loop(view)


def _hands_off_with_cores(cores: set[int], nbytes: int) -> bool:
    """``hashes_off_loop(nbytes)`` in a fresh process allowed only ``cores``."""
    code = (f"import os; os.sched_setaffinity(0, {sorted(cores)!r}); "
            "from kv_offload_sidecar.data.checksum_threads import hashes_off_loop; "
            f"print(hashes_off_loop({nbytes}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_a_chunk_leaves_the_loop_only_when_big_enough_and_a_second_core_can_hash_it() -> None:
    cores = os.sched_getaffinity(0)
    one = {min(cores)}
    assert not _hands_off_with_cores(one, OFF_LOOP_BYTES)  # one core: a thread only takes turns
    two = set(sorted(cores)[:2])  # a host with one core fails here: the rule needs two to show
    assert _hands_off_with_cores(two, OFF_LOOP_BYTES)
    assert not _hands_off_with_cores(two, OFF_LOOP_BYTES - 1)


def test_checksum_threads_follow_the_cpu_budget() -> None:
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        cpu_budget.cache_clear()
        assert checksum_threads() == 1
        os.sched_setaffinity(0, before)
        cpu_budget.cache_clear()
        assert checksum_threads() == max(1, min(MAX_DATA_LANES, cpu_budget().cpus))
    finally:
        os.sched_setaffinity(0, before)
        cpu_budget.cache_clear()
