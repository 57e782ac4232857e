"""Repeated runs as figures: each kind's windows become one median window, each source's
hits one median hit."""

from __future__ import annotations

from kv_offload_tools.bench.vllm_ttft.figures import median_hit, median_window


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


def test_the_hit_figure_is_the_run_whose_ttft_is_the_median_with_its_own_phases() -> None:
    hits = [{"ttft_s": 0.31, "phases": {"load.fetch": 0.2}, "hit": True},
            {"ttft_s": 0.45, "phases": {"load.fetch": 0.3}, "hit": False},  # not the figure
            {"ttft_s": 0.29, "phases": {"load.fetch": 0.1}, "hit": True}]
    fig = median_hit(hits)
    assert (fig["ttft_s"], fig["phases"]) == (0.31, {"load.fetch": 0.2})
    assert fig["ttft_runs_s"] == [0.31, 0.45, 0.29]  # every run, in the order taken
    assert fig["full_hit_runs"] == [True, False, True]
    assert median_hit(hits[:1])["ttft_s"] == 0.31
