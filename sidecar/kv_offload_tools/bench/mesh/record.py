"""What a ``bench mesh --record`` run's record shows: descriptors, threads and memory per sidecar."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench_records.shape import Column, Figures, Table, key


def _summary(phase: str, metric: str) -> Any:
    return lambda r: r["phases"][phase]["summary"][metric]


def _fds(phase: str, spread: bool = False) -> Any:
    def cell(r: dict[str, Any]) -> str:
        m = _summary(phase, "fds")(r)
        return f"{m['mean']:.1f} ({m['min']}-{m['max']})" if spread else f"{m['mean']:.1f}"

    return cell


def _handshakes(r: dict[str, Any]) -> str:
    accepted = r["join"]["handshakes"]["accepted"]
    return f"{accepted:,.0f} ({accepted / r['pods']:.1f})"


def _rss(r: dict[str, Any]) -> str:
    s = r["phases"]["joined"]["summary"]
    return f"{s['rss_bytes']['mean'] / 2**20:.1f} MiB ({s['rss_anon_bytes']['mean'] / 2**20:.1f})"


FIGURES = Figures(
    tables=(
        Table(
            "Many real sidecars",
            lambda report: report["results"],
            (
                Column("pods", key("pods")),
                Column("settled after", key("join", "settled_seconds", fmt="{:.1f} s")),
                Column("handshakes counted (per sidecar)", _handshakes),
                Column("descriptors joined", _fds("joined")),
                Column("after the workload", _fds("workload", spread=True)),
                Column("after idle", _fds("after_idle")),
                Column("threads", lambda r: f"{_summary('joined', 'threads')(r)['mean']:.1f}"),
                Column("RSS joined (anonymous)", _rss),
            ),
        ),
    ),
    figures={
        "descriptors_order": lambda report: str(report["descriptors"]["order"]),
    },
)
