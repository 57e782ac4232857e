"""Inter-token windows as figures: each kind's windows become one median window."""

from __future__ import annotations

from kv_offload_tools.bench.vllm_ttft_measure import median_window


def _window(p99: float | None, end: str = "stored") -> dict:
    return {"p50_ms": None if p99 is None else p99 / 2, "p99_ms": p99, "window_end": end}


def test_the_figure_is_the_window_whose_p99_is_the_median_and_lists_every_window() -> None:
    windows = [_window(40.0, "a"), _window(25.0, "b"), _window(31.0, "c")]
    fig = median_window(windows)
    # One slow step in one window does not become the figure; the median window's own
    # p50 and end state come with its p99.
    assert (fig["p99_ms"], fig["p50_ms"], fig["window_end"]) == (31.0, 15.5, "c")
    assert fig["runs"] == windows


def test_a_window_without_intervals_is_listed_but_not_the_figure() -> None:
    windows = [_window(None), _window(30.0), _window(20.0)]
    fig = median_window(windows)
    assert fig["p99_ms"] == 20.0 and len(fig["runs"]) == 3
    # With no window timed, the figure carries no p99 (no target is met on it).
    assert median_window([_window(None)])["p99_ms"] is None
