"""One small ChaosBench per test module (started once, its faults injected test by test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fault_support import SETTINGS
from kv_offload_tools.chaos.faults.bench import ChaosBench


@pytest.fixture(scope="module")
def bench() -> Iterator[ChaosBench]:
    with ChaosBench(SETTINGS) as b:
        yield b
