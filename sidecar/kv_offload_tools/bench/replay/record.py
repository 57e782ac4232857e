"""What a ``bench replay --record`` run's record shows: hit ratios by replica count, the run
itself, and the prefill time saved per modelled link."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench_records.shape import Column, Figures, Table, key


def _sweep(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**s, "chunk_bytes": report["chunk_bytes"]} for s in report["sweep"]]


def _ratio(row: dict[str, Any]) -> float:
    return row["p2p_hit_ratio"] / row["pooled_lru_hit_ratio"]


def hit_ratio_vs_one_lru(report: dict[str, Any]) -> str:
    """The pool's hit ratio over one LRU cache of its total size, over every replica count run."""
    ratios = [_ratio(r) for r in (report["sweep"] or [report]) if r["pooled_lru_hit_ratio"]]
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


FIGURES = Figures(
    tables=(
        Table(
            "Hit ratio by replicas",
            _sweep,
            (
                Column("replicas", key("replicas")),
                Column("kv-offload P2P", key("p2p_hit_ratio", fmt="{:.3f}")),
                Column("pooled LRU", key("pooled_lru_hit_ratio", fmt="{:.3f}")),
                Column("P2P / pooled", lambda r: f"{_ratio(r):.3f}"),
                Column("local only", key("local_only_hit_ratio_simulated", fmt="{:.3f} (sim.)")),
                Column("bytes moved per hit", lambda r: f"{r['bytes_moved_per_hit'] / r['chunk_bytes']:.2f} chunk"),
                Column("peer messages / peer-hit request", key("lookup_messages_per_peer_hit_request", fmt="{:.2f}")),
            ),
        ),
        Table(
            "The run",
            lambda report: [report],
            (
                Column("workload", key("workload")),
                Column("replicas", key("replicas")),
                Column("routing", key("routing")),
                Column("kv-offload P2P", key("p2p_hit_ratio", fmt="{:.3f}")),
                Column("local only (measured)", key("local_only_hit_ratio", fmt="{:.3f}")),
                Column("pooled LRU", key("pooled_lru_hit_ratio", fmt="{:.3f}")),
                Column("bytes moved per hit", lambda r: f"{r['bytes_moved_per_hit'] / r['chunk_bytes']:.2f} chunk"),
                Column("peer messages / request", key("lookup_messages_per_request", fmt="{:.2f}")),
            ),
        ),
        Table(
            "Prefill time saved per modelled link",
            lambda report: report["prefill"],
            (
                Column("link", key("link_gb_per_second", fmt="{:g} GB/s")),
                Column("prefill time saved, always fetch", lambda r: f"{r['saved_always_fetch'] * 100:.1f} %"),
                Column("saved, fetch or recompute", lambda r: f"{r['saved_fetch_or_recompute'] * 100:.1f} %"),
                Column(
                    "peer runs fetched / recomputed",
                    lambda r: f"{r['peer_runs_fetched']:,} / {r['peer_runs_recomputed']:,}",
                ),
            ),
        ),
    ),
    figures={"hit_ratio_vs_one_lru": hit_ratio_vs_one_lru},
)
