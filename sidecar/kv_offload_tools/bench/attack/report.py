"""The report of ``kv-offload bench attack``: the pool's figures, the targets, the table, the plot.

Targets (issue 25), for one run: the largest RSS growth of any member at most
32 MiB at the attack's peak and 8 MiB after it (under up to 1,000 hostile
connections); the members' logs growing by at most 64 KiB per minute of attack
(an attack shorter than a minute counts as one); no traceback in any member's
log; no response of 500; every member alive and connected at the end; the
honest load's hit ratio not below the runs without attackers and its p99 load
time at most 1.5x theirs. Two more
lines check what the issue says a stranger must not get: the wire version
before the proof, and a replayed handshake step accepted.
"""

from __future__ import annotations

from typing import Any

MIB = 1 << 20
# Targets: RSS growth of a member (bytes) at the peak and after; log bytes per minute.
RSS_PEAK_LIMIT = 32 * MIB
RSS_AFTER_LIMIT = 8 * MIB
LOG_BYTES_PER_MINUTE = 64 * 1024
P99_RATIO_LIMIT = 1.5


def pool_figures(before: Any, peak: dict[str, tuple[int, int]], after: Any, log_bytes: int,
                 attack_seconds: float) -> dict[str, Any]:
    """Per member: RSS and descriptors before / at peak / after; the logs' growth per minute."""
    members = {}
    for ident, (rss0, fds0, _log0) in before.members.items():
        rss1, fds1, _ = after.members[ident]
        members[ident] = {"rss_mib": [round(rss0 / MIB, 1), round(peak[ident][0] / MIB, 1), round(rss1 / MIB, 1)],
                          "fds": [fds0, peak[ident][1], fds1],
                          "rss_peak_growth": peak[ident][0] - rss0, "rss_after_growth": rss1 - rss0}
    # An attack shorter than a minute counts as one minute (the sidecars summarise rejections
    # per minute: their first lines of a minute come at once); the raw rate is kept too.
    minutes = max(attack_seconds, 60.0) / 60
    return {"members": members, "log_bytes": log_bytes, "attack_seconds": round(attack_seconds, 1),
            "log_bytes_per_minute": round(log_bytes / minutes),
            "log_bytes_per_minute_raw": round(log_bytes * 60 / max(attack_seconds, 1e-9))}


def targets(pool: dict[str, Any], results: list[dict[str, Any]], tracebacks: dict[str, list[str]],
            connected: dict[str, str], baseline: dict[str, float], attacked: dict[str, float],
            connections: int, leaked_version: bool, replays_accepted: int,
            other_weights_bytes: int = 0) -> list[dict[str, Any]]:
    """Every target: what was measured, the limit, PASS or FAIL."""
    m = pool["members"]
    worst_peak = max(m, key=lambda k: m[k]["rss_peak_growth"])
    worst_after = max(m, key=lambda k: m[k]["rss_after_growth"])
    peak, after = m[worst_peak]["rss_peak_growth"], m[worst_after]["rss_after_growth"]
    n_tb = sum(len(v) for v in tracebacks.values())
    n_500 = sum(r["http_500"] for r in results if not r["name"].startswith("  "))
    wrong = {k: v for k, v in connected.items() if v}
    hit_a, hit_b = attacked["hit_ratio"] or 0.0, baseline["hit_ratio"] or 0.0
    p99_ratio = attacked["load_p99_ms"] / baseline["load_p99_ms"] if baseline["load_p99_ms"] else float("inf")
    rows = [
        (f"RSS growth at peak <= 32 MiB ({connections} hostile connections)",
         f"{peak / MIB:.1f} MiB ({worst_peak})", peak <= RSS_PEAK_LIMIT),
        ("RSS growth after <= 8 MiB", f"{after / MIB:.1f} MiB ({worst_after})", after <= RSS_AFTER_LIMIT),
        ("log growth <= 64 KiB per minute of attack",
         f"{pool['log_bytes_per_minute'] / 1024:.1f} KiB/min ({pool['log_bytes'] / 1024:.0f} KiB in "
         f"{pool['attack_seconds']:.0f} s, at least a minute counted; "
         f"{pool['log_bytes_per_minute_raw'] / 1024:.0f} KiB/min over those seconds)",
         pool["log_bytes_per_minute"] <= LOG_BYTES_PER_MINUTE),
        ("0 tracebacks in the members' logs", str(n_tb), n_tb == 0),
        ("0 responses of 500", str(n_500), n_500 == 0),
        ("every member alive and connected", "yes" if not wrong else
         "; ".join(f"{k}: {v}" for k, v in wrong.items()), not wrong),
        ("honest hit ratio unchanged", f"{hit_a:.4f} vs {hit_b:.4f} without attackers "
         f"({attacked['wrong']} wrong chunks)", hit_a >= hit_b and attacked["wrong"] == 0),
        ("honest p99 load time <= 1.5x without attackers",
         f"{p99_ratio:.2f}x ({attacked['load_p99_ms']:.1f} ms vs {baseline['load_p99_ms']:.1f} ms)",
         p99_ratio <= P99_RATIO_LIMIT),
        ("no wire version told before the proof", "told" if leaked_version else "not told", not leaked_version),
        ("replayed handshake steps refused", f"{replays_accepted} accepted", replays_accepted == 0),
        ("0 chunk bytes to a key holder of other weights (same name and path)",
         f"{other_weights_bytes} bytes", other_weights_bytes == 0),
    ]
    return [{"target": t, "measured": v, "pass": ok} for t, v, ok in rows]


def _answers(r: dict[str, Any], width: int = 70) -> str:
    text = ", ".join(f"{k} x{v}" for k, v in sorted(r["answers"].items(), key=lambda kv: -kv[1]))
    return text if len(text) <= width else text[:width - 3] + "..."


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'attack':<34} {'port':<12} {'sent':>5} {'cut':>9} {'log B':>8} {'tb':>3} {'500':>4} "
            f"{'RSS+MiB':>8} {'fds+':>5} {'hit':>6} {'p99 ms':>7} {'CPU%':>5}  answers")
    lines = [head, "-" * len(head)]
    for r in results:
        cut = "" if r["cut"] is None else f"{r['cut']}" + (f"/{r['cut_median_seconds']}s"
                                                          if r["cut_median_seconds"] is not None else "")
        h = r["honest"]
        hit = "-" if h.get("hit_ratio") is None else f"{h['hit_ratio']:.3f}"
        p99 = "-" if not h.get("rounds") else f"{h['load_p99_ms']:.1f}"
        seconds = r["ended"] - r["started"]
        cpu = ("-" if seconds <= 0 or not r.get("target_cpu_seconds") else
               f"{100 * r['target_cpu_seconds'] / seconds:.0f}")  # the target's, of one core
        lines.append(f"{r['name'][:34]:<34} {r['port']:<12} {r['sent']:>5} {cut:>9} {r['log_bytes']:>8} "
                     f"{r['tracebacks']:>3} {r['http_500']:>4} {r['rss_peak_growth'] / MIB:>8.1f} "
                     f"{r['fds_peak_growth']:>5} {hit:>6} {p99:>7} {cpu:>5}  "
                     f"{_answers(r)}")
    return "\n".join(lines)


def counters_lines(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in results:
        if r["counters"]:
            moved = ", ".join(f"{k} +{v:g}" for k, v in list(r["counters"].items())[:8])
            out.append(f"- {r['name'].strip()}: {moved}")
        for note in r["notes"]:
            if note.startswith("while all were held"):
                continue  # printed once, from the report's during_siege
            out.append(f"- {r['name'].strip()}: {note}")
    return out


def pool_lines(pool: dict[str, Any]) -> list[str]:
    out = []
    for ident, m in pool["members"].items():
        r, f = m["rss_mib"], m["fds"]
        out.append(f"{ident}: RSS {r[0]} -> peak {r[1]} -> after {r[2]} MiB; "
                   f"descriptors {f[0]} -> peak {f[1]} -> after {f[2]}")
    return out


def plot(report: dict[str, Any], series: dict[str, Any], path: str) -> None:
    """RSS and descriptors of each member over time, the honest load's times, attacks shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(13, 9), sharex=True)
    for ident, points in series["rss"].items():
        axes[0].plot([t for t, _ in points], [v / MIB for _, v in points], label=ident)
    for ident, points in series["fds"].items():
        axes[1].plot([t for t, _ in points], [v for _, v in points], label=f"{ident} descriptors")
    for name, points in series["gauges"].items():
        axes[1].plot([t for t, _ in points], [v for _, v in points], ":", color="black", label=name)
    axes[2].plot([t for t, _ in series["loads"]], [v for _, v in series["loads"]], ".", ms=2)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("open descriptors")
    axes[2].set_ylabel("honest load (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds since the first run without attackers began (grey: no attackers)")
    top = [r for r in report["attacks"] if not r["name"].startswith("  ")]
    colors = ("#f4cccc", "#cfe2f3", "#d9ead3", "#fff2cc", "#ead1dc")
    span = max((r["ended"] for r in top), default=1.0) or 1.0
    narrow = []
    for i, r in enumerate(top):
        for ax in axes:
            ax.axvspan(r["started"], r["ended"], color=colors[i % len(colors)], alpha=0.6, lw=0)
        wide = r["ended"] - r["started"] > 0.03 * span
        label = r["name"][:24] if wide else str(i + 1)
        if not wide:
            narrow.append(f"{i + 1} {r['name']}")
        axes[0].text((r["started"] + r["ended"]) / 2, 0.98, label, rotation=90 if wide else 0, va="top",
                     ha="center", fontsize=6, transform=axes[0].get_xaxis_transform())
    if narrow:
        axes[2].text(0.99, 0.98, "\n".join(narrow), transform=axes[2].transAxes, ha="right", va="top",
                     fontsize=6, bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    for b in report["baseline_windows"]:
        for ax in axes:
            ax.axvspan(b[0], b[1], color="#eeeeee", alpha=0.6, lw=0)
    axes[0].legend(fontsize=7, loc="upper left")
    axes[1].legend(fontsize=7, loc="upper left")
    verdict = ", ".join(("PASS " if t["pass"] else "FAIL ") + t["target"].split(" <=")[0].split(" (")[0]
                        for t in report["targets"])
    fig.suptitle(f"kv-offload bench attack: {verdict}", fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
