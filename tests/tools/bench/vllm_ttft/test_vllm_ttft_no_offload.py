"""The store window's references: the ratio a plane's store window is held to."""

from __future__ import annotations

import pytest

from kv_offload_tools.bench.vllm_ttft.no_offload import store_over_reference


def _itl(store_p99: float | None, quiet_p99: float | None) -> dict:
    return {"store": {"p99_ms": store_p99}, "quiet": {"p99_ms": quiet_p99}}


def test_a_store_window_is_scaled_by_its_own_quiet_and_the_reference_engines_prefill_ratio() -> None:
    # The baseline's prefill alone took p99 to 1.25x its quiet: a plane whose quiet p99 is
    # 20 ms gets 25 ms without offloading, so a 30 ms store window is 1.2x that.
    assert store_over_reference(_itl(30.0, 20.0), {"prefill_over_quiet": 1.25}) == \
        pytest.approx(1.2)
    # The same store window on a slower sitting (quiet 30 ms) is within its reference.
    assert store_over_reference(_itl(30.0, 30.0), {"prefill_over_quiet": 1.25}) == \
        pytest.approx(0.8)


@pytest.mark.parametrize("itl, reference", [
    (_itl(30.0, 20.0), None),                          # no baseline reference (no ITL run)
    (_itl(30.0, 20.0), {"prefill_over_quiet": None}),  # the baseline had no quiet p99
    (_itl(None, 20.0), {"prefill_over_quiet": 1.2}),   # the store window held no interval
    (_itl(30.0, 0.0), {"prefill_over_quiet": 1.2}),
])
def test_without_a_reference_or_a_window_there_is_no_ratio(itl, reference) -> None:
    assert store_over_reference(itl, reference) is None
