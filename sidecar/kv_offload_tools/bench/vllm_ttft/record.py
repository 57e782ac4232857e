"""What a ``bench vllm --record`` run's record shows: the tables the bench prints (TTFT by
plane and prefix, the hits' phases, CPU per GB, the store, inter-token latency), and the
targets met."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench.vllm_ttft.report import table
from kv_offload_tools.bench_records.shape import Figures, markdown_tables


def targets_met(report: dict[str, Any]) -> str:
    """``53 of 54 targets met``."""
    met = sum(1 for t in report["targets"] if t["met"])
    return f"{met} of {len(report['targets'])} targets met"


FIGURES = Figures(
    tables=(lambda report: markdown_tables(table(report), "Time to first token inside vLLM"),),
    figures={"targets_met": targets_met},
)
