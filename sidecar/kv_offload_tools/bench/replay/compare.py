"""Side by side: replay reports of one workload under different routings or sharing policies.

``kv-offload bench replay --compare A.json,B.json,...`` reads reports that
``kv-offload bench replay --json`` wrote and prints one table (hit ratios,
bytes moved per hit, messages) and, with ``--plot``, one PNG: hit ratio
(P2P, local only, pooled LRU) and bytes moved per hit, one group per report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def load_reports(paths: Sequence[str]) -> list[dict]:
    reports = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                report = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--compare {path}: not a readable replay report ({exc})") from None
        if not isinstance(report, dict) or "p2p_hit_ratio" not in report:
            raise ValueError(f"--compare {path}: not a 'kv-offload bench replay --json' report")
        reports.append(report)
    return reports


def label(report: dict) -> str:
    return f"{report['routing']}, {report.get('peer_copies', 'drop')}"


def format_comparison(reports: Sequence[dict]) -> str:
    head = ("  routing, peer copies             p2p     local   pooled  p2p/pooled  bytes/hit  "
            "msgs/request  hint msgs/request")
    lines = [f"replay of {reports[0]['workload']}, {reports[0]['replicas']} replicas x "
             f"{reports[0]['capacity_chunks']} chunks", head]
    for r in reports:
        ratio = r["p2p_hit_ratio"] / r["pooled_lru_hit_ratio"] if r["pooled_lru_hit_ratio"] else 0.0
        lines.append(f"  {label(r):<32}  {r['p2p_hit_ratio']:.4f}  {r['local_only_hit_ratio']:.4f}  "
                     f"{r['pooled_lru_hit_ratio']:.4f}  {ratio:<10.3f}  {r.get('bytes_moved_per_hit', 0):<9.0f}  "
                     f"{r['lookup_messages_per_request']:<12.3f}  {r.get('hint_messages_per_request', 0):.3f}")
    return "\n".join(lines)


def write_comparison_plot(path: str, reports: Sequence[dict]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(r).replace(", ", "\n") for r in reports]
    xs = range(len(reports))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, (key, what) in enumerate((("p2p_hit_ratio", "kv-offload P2P (measured)"),
                                     ("local_only_hit_ratio", "local only (measured)"),
                                     ("pooled_lru_hit_ratio", "pooled LRU (simulated)"))):
        bars = ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in reports], width, label=what)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("chunk hit ratio")
    ax.set_ylim(0, 1.15)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    r0 = reports[0]
    ax.set_title(f"{r0['workload']}: {r0['replicas']} replicas x {r0['capacity_chunks']} chunks", fontsize=9)
    bars = ax2.bar(list(xs), [r.get("bytes_moved_per_hit", 0) / 1024 for r in reports], 0.5, color="tab:green")
    ax2.bar_label(bars, fmt="%.2f", fontsize=8)
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel(f"KiB moved between pods per chunk hit (chunks of {r0['chunk_bytes']} B)")
    ax2.set_title("bytes moved per hit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
