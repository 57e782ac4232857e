"""What a ``bench chaos --record`` run's record shows: one row per fault class (a fault run),
or per fuzzed message with the total (``--fuzz``), as the bench prints them."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench_records.shape import Column, Figures, Table, key, keyed


def _store(r: dict[str, Any]) -> str:
    if not r["store_budget_bytes"]:
        return "-"
    return f"{r['store_peak_bytes'] / 2**20:.2f} / {r['store_budget_bytes'] / 2**20:.2f} MiB"


def _messages(report: dict[str, Any]) -> list[dict[str, Any]]:
    targets = report.get("targets", [])
    if not targets:
        return []
    total = {k: sum(t[k] for t in targets) for k in ("cases", "answers", "errors", "incomplete", "failures")}
    return [*targets, {**total, "target": "**total**"}]


def invariants(report: dict[str, Any]) -> str | None:
    """A fault run's: ``0 corrupt chunks delivered, 0 lost``."""
    if "faults" not in report:
        return None
    corrupt = sum(r["corrupt_delivered"] for r in report["faults"])
    return f"{corrupt} corrupt chunks delivered, {sum(r['lost'] for r in report['faults'])} lost"


def fuzz(report: dict[str, Any]) -> str | None:
    """A fuzz run's: ``10,000 cases: 0 failures, 0 crashes``."""
    if "targets" not in report:
        return None
    return f"{report['cases']:,} cases: {report['failures']} failures, {report['crashes']} crashes"


FIGURES = Figures(
    tables=(
        Table(
            "Faults injected",
            lambda report: report.get("faults", []),
            (
                *keyed(
                    ("fault", "fault"),
                    ("injected", "injected"),
                    ("in flight", "in_flight"),
                    ("survived", "survived"),
                    ("loads", "loads"),
                    ("loads turned into misses", "loads_missed"),
                    ("corrupt chunks delivered", "corrupt_delivered"),
                    ("chunks lost", "lost"),
                    ("chunks refused by checksum", "integrity_rejected"),
                ),
                Column("worst give-up (s)", key("worst_give_up_seconds", fmt="{:.3f}")),
                Column("store peak / budget", _store),
            ),
        ),
        Table(
            "Fuzzed messages",
            _messages,
            keyed(
                ("message", "target"),
                ("cases", "cases"),
                ("correct answers", "answers"),
                ("clear errors", "errors"),
                ("incomplete input", "incomplete"),
                ("failures", "failures"),
            ),
        ),
    ),
    figures={"invariants": invariants, "fuzz": fuzz},
)
