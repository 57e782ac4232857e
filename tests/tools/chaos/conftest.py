"""Fixtures of the chaos tests: pools of real sidecar processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_tools.chaos.pool import chaos_pool as make_chaos_pool
from kv_offload_testing.local_pool import LocalPool


@pytest.fixture
def chaos_pool() -> Iterator[LocalPool]:
    """An empty pool (16 KiB chunks, 4 MiB stores); every sidecar is stopped at teardown."""
    with make_chaos_pool(16 * 1024, 4 << 20, fetch_deadline_seconds=1.0) as pool:
        yield pool
