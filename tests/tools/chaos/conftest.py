"""Fixtures of the chaos tests: pools of real sidecar processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_tools.bench.chaos_support import ChaosPool


@pytest.fixture
def chaos_pool() -> Iterator[ChaosPool]:
    """An empty pool (16 KiB chunks, 4 MiB stores); every process is killed at teardown."""
    pool = ChaosPool(chunk_bytes=16 * 1024, capacity_bytes=4 << 20, fetch_deadline_seconds=1.0)
    try:
        yield pool
    finally:
        pool.close()
