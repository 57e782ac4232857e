"""What a ``bench scale --record`` run's record shows: the where-is-what table per pod count."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench.scale.report import _mbps, _mib
from kv_offload_tools.bench_records.shape import Column, Figures, Table, key


def _join(r: dict[str, Any]) -> str:
    j = r["join"]
    return f"{j['joiner_bytes_received'] / 1e6:.2f} MB ({j['joiner_entries_received'] / 1e3:.1f}k entries)"


def _leave(r: dict[str, Any]) -> str:
    v = r["leave"]
    return f"{v['bytes_sent_by_each_member'] / 1e3:.0f} kB ({v['entries_resent_by_each_member']:,.0f} entries)"


FIGURES = Figures(
    tables=(
        Table(
            "Where-is-what per sidecar, by pool size",
            lambda report: report["results"],
            (
                Column("pods", key("pods", fmt="{:,}")),
                Column("location memory / sidecar", lambda r: _mib(r["location_bytes_per_sidecar"])),
                Column("control traffic / pod (in + out)", lambda r: _mbps(r["control_bytes_per_second_per_pod"])),
                Column("messages / lookup", key("messages_per_lookup", fmt="{:.2f}")),
                Column("messages / peer-hit request", key("messages_per_peer_hit_request", fmt="{:.2f}")),
                Column("false-positive peer lookups", lambda r: f"{r['false_positive_ratio'] * 100:.2f} %"),
                Column("hit ratio vs exact", key("hit_ratio_vs_exact", fmt="{:.3f}")),
                Column("join: the joiner receives", _join),
                Column("leave: each member resends", _leave),
            ),
        ),
    ),
    figures={
        "location_memory_largest_pool": lambda report: _mib(report["results"][-1]["location_bytes_per_sidecar"]),
    },
)
