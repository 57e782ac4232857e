"""Hypothesis fuzzing of every message a live sidecar accepts (bounded; the bench runs 10,000+).

Each case must end in a clear error or the correct answer (chaos_fuzz.py has
the oracles); after each target the sidecar must still answer /healthz and hold
no reservation beyond its visible chunks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_offload_sidecar.bench.chaos_fuzz import (
    FUZZ_CHUNK_BYTES,
    TARGETS,
    FuzzContext,
    FuzzResult,
    run_target,
    start_fuzz_sidecar,
)
from kv_offload_sidecar.bench.chaos_support import ChaosPool

EXAMPLES = 120


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[FuzzContext]:
    pool = ChaosPool(chunk_bytes=FUZZ_CHUNK_BYTES, capacity_bytes=32 << 20)
    try:
        yield start_fuzz_sidecar(pool)
    finally:
        pool.close()


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_fuzzed_messages_get_a_clear_error_or_the_right_answer(fuzzed: FuzzContext, target) -> None:
    result = FuzzResult()
    stats = run_target(fuzzed, target, EXAMPLES, result, raise_failures=True)
    assert stats.cases >= 10  # hypothesis really ran cases against the sidecar
    assert stats.failures == 0, stats.first_failure
    assert result.crashes == 0 and result.hangs == 0


def test_fuzzed_sidecar_is_alive_and_small_after_every_target(fuzzed: FuzzContext) -> None:
    assert fuzzed.sidecar.alive
    assert fuzzed.sidecar.rss_bytes() < 512 << 20
    status = fuzzed.sidecar.status()
    assert status["store"]["used_bytes"] == status["store"]["chunks"] * status["store"]["slot_stride"]
