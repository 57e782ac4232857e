"""The benches' percentiles are nearest rank: a value some sample really had; none of no samples."""

from __future__ import annotations

from kv_offload_tools.bench.quantile import quantile


def test_the_quantile_is_the_sorted_value_at_its_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert quantile(values, 0.5) == 51.0
    assert quantile(values, 0.99) == 100.0
    assert quantile(values, 0.0) == 1.0


def test_a_high_quantile_of_few_samples_is_the_largest() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert quantile([7.0], 0.5) == 7.0


def test_no_samples_have_no_quantile() -> None:
    assert quantile([], 0.5) is None
