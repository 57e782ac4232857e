"""What a ``bench netns --record`` run's record shows: requests for a holder behind a capped
link (per half of the window), and each churn round."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench_records.shape import Column, Figures, Table, key


def _v(value: Any, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def _halves(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for run, c in report.get("capped", {}).items():
        for half in ("first_half", "second_half"):
            rows.append(
                {
                    **c[half],
                    "run": run,
                    "half": half.split("_")[0],
                    "decisions": c["decisions"],
                    "max_link_failures": c["max_link_failures"],
                    "first": half == "first_half",
                }
            )
    return rows


def _decisions(r: dict[str, Any]) -> str:
    return f"{r['decisions']['fetch']:g} / {r['decisions']['recompute']:g}" if r["first"] else ""


FIGURES = Figures(
    tables=(
        Table(
            "A holder behind a slow link (capped)",
            _halves,
            (
                Column("run", key("run")),
                Column("half", key("half")),
                Column("requests", key("requests")),
                Column("p50 ms", lambda r: _v(r["p50_ms"])),
                Column("p99 ms", lambda r: _v(r["p99_ms"])),
                Column("stalled", key("stalled")),
                Column("decisions fetch / recompute", _decisions),
                Column("largest failure count", lambda r: str(r["max_link_failures"]) if r["first"] else ""),
            ),
        ),
        Table(
            "Churn",
            lambda report: report.get("churn", {}).get("rounds", []),
            (
                Column("round", key("round")),
                Column("survivors' links to departed pods left connected", key("departed_links_left")),
                Column("links live after", lambda r: _v(r["seconds_until_links_live"], "{:.2f} s")),
                Column(
                    "departed addresses forgotten after",
                    lambda r: _v(r["seconds_until_departed_forgotten"], "{:.2f} s"),
                ),
                Column("rejoined after", lambda r: _v(r["seconds_until_rejoined"], "{:.2f} s")),
                Column("share through a restarted pod", lambda r: "/".join(map(str, r["shared"]))),
                Column("survivors' fds", lambda r: ", ".join(str(v) for v in r["fds"].values())),
                Column("survivors' RSS MiB", lambda r: ", ".join(str(v) for v in r["rss_mib"].values())),
            ),
        ),
    ),
)
