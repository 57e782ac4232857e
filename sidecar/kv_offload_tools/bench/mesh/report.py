"""The fits, the target check, the table and the plot of ``kv-offload bench mesh``.

``descriptor_order`` fits the mean descriptors per sidecar against pods, phase by phase
(least squares: the slope is descriptors per extra pod), and fits every sidecar's
descriptors against its peers with open data lanes within each reading of a pool
(descriptors per data link; measurable once sidecars of one pool differ in data links). The target
("descriptors per sidecar O(links), not O(pool)") is met when, in the phases where the
pool is idle (``joined``: after the mass join settled; ``after_idle``: after the workload
and an idle period), descriptors grow by at most ``max_per_pod`` per extra pod: a pool
that links every pair grows by its sockets per peer (about 2 per lane plus the session's)
with every pod, one that links on demand stays flat while idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Phases of one pod count, in the order measured.
PHASES = ("joined", "workload", "after_idle")
# The phases the target is judged on: the pool idle.
IDLE_PHASES = ("joined", "after_idle")


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares ``(slope, intercept)`` of ys against xs; None when xs do not vary."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def within_pool_slope(groups: Sequence[Sequence[tuple[float, float]]]) -> float | None:
    """Slope of y against x within groups (each reading of one pool): every group's points
    taken about its own means, so what all sidecars of a pool share (the sessions to every
    member) drops out; None when x never varies within a group."""
    sxy = sxx = 0.0
    for points in groups:
        if not points:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        sxy += sum((x - mx) * (y - my) for x, y in points)
        sxx += sum((x - mx) ** 2 for x, _ in points)
    return sxy / sxx if sxx else None


def descriptor_order(rows: Sequence[dict[str, Any]], max_per_pod: float) -> dict[str, Any]:
    """Descriptors per extra pod in every phase, descriptors per link, and the target's verdict."""
    pods = [r["pods"] for r in rows]
    per_phase: dict[str, Any] = {}
    for phase in PHASES:
        line = fit(pods, [r["phases"][phase]["summary"]["fds"]["mean"] for r in rows])
        per_phase[phase] = None if line is None else {"descriptors_per_extra_pod": line[0],
                                                      "intercept": line[1]}
    per_link = within_pool_slope([[(s["data_linked_peers"], s["fds"]) for s in r["phases"][p]["sidecars"]]
                                  for r in rows for p in PHASES])
    slopes = [per_phase[p]["descriptors_per_extra_pod"] for p in IDLE_PHASES if per_phase[p] is not None]
    if len(slopes) < len(IDLE_PHASES):
        verdict, meets = "unknown: needs two pod counts or more", None
    else:
        meets = max(slopes) <= max_per_pod
        verdict = "O(links)" if meets else "O(pool)"
    return {"per_phase": per_phase, "max_descriptors_per_extra_pod": max_per_pod,
            "descriptors_per_data_link": per_link,
            "order": verdict, "meets_target": meets}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_table(report: dict[str, Any]) -> str:
    s = report["settings"]
    out = [f"bench mesh: real sidecars on this host ({report['host_cpus']} cpus, {s['capacity_mib']:g} MiB "
           f"stores); up to {s['writers']} pods store {s['chunks']} chunks each, up to {s['readers']} others "
           f"read them all; idle {s['settle_seconds']:g} s after the join, {s['idle_seconds']:g} s after the workload"]
    for r in report["results"]:
        j, h = r["join"], r["join"]["handshakes"]
        out += ["", f"{r['pods']} sidecars: identities stated after {j['identities_stated_seconds']:.1f} s, ready "
                f"after {j['ready_seconds']:.1f} s, settled after {j['settled_seconds']:.1f} s; {r['lanes_offered']} "
                "lanes offered",
                f"  join: {h['accepted']:.0f} handshakes counted ({h['accepted'] / r['pods']:.1f} per sidecar, each "
                f"end counts its own), {h['rejected']:.0f} rejected; refused at the door: "
                f"{h['too_many_connections']:.0f} connections, {h['rate_limited']:.0f} handshakes; "
                f"{h['dial_failures']:.0f} dial failures",
                f"  {'phase':<11}{'fds':>7}{'(min-max)':>11}{'sockets':>9}{'threads':>9}{'RSS MiB':>9}"
                f"{'anon MiB':>10}{'connected':>11}{'data-linked':>13}{'lanes':>7}"]
        for phase in r["phases"]:
            m = r["phases"][phase]["summary"]
            out.append(f"  {phase:<11}{m['fds']['mean']:>7.1f}{m['fds']['min']:>6}-{m['fds']['max']:<4}"
                       f"{m['sockets']['mean']:>9.1f}{m['threads']['mean']:>9.1f}{_mib(m['rss_bytes']['mean']):>9}"
                       f"{_mib(m['rss_anon_bytes']['mean']):>10}{m['connected_peers']['mean']:>11.1f}"
                       f"{m['data_linked_peers']['mean']:>13.1f}{m['data_lanes']['mean']:>7.1f}")
        w = r["workload"]
        out.append(f"  workload: {len(w['writers'])} pods stored {w['stored']}/{w['expected_stored']}, "
                   f"loaded {w['loaded']}/{w['expected_loaded']} into {len(w['readers'])} pods, "
                   f"{w['wrong']} wrong, {w['seconds']:.1f} s")
    o = report["descriptors"]
    out.append("")
    for phase, line in o["per_phase"].items():
        if line is not None:
            out.append(f"descriptors per sidecar, {phase}: {line['descriptors_per_extra_pod']:+.2f} per extra pod "
                       f"(+ {line['intercept']:.1f})")
    per_link = o["descriptors_per_data_link"]
    out.append("descriptors per peer with open data lanes, within a pool: "
               + ("not measurable (every sidecar of a pool had as many)" if per_link is None else f"{per_link:.2f}"))
    status = {True: "met", False: "MISSED", None: "not judged"}[o["meets_target"]]
    out.append(f"target: descriptors per sidecar O(links), not O(pool) (idle: at most "
               f"{o['max_descriptors_per_extra_pod']:g} per extra pod): {o['order']}, {status}")
    last = report["results"][-1]["phases"]["joined"]["summary"]
    out.append(f"RSS per idle sidecar at {report['results'][-1]['pods']} pods: {_mib(last['rss_bytes']['mean'])} MiB "
               f"({_mib(last['rss_anon_bytes']['mean'])} MiB anonymous)")
    if report.get("plot"):
        out.append(f"plot: {report['plot']}")
    return "\n".join(out)


def write_plot(path: str, report: dict[str, Any]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    pods = [r["pods"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = ((axes[0][0], "fds", 1, "descriptors per sidecar"), (axes[0][1], "threads", 1, "threads per sidecar"),
              (axes[1][0], "rss_bytes", 2**20, "RSS per sidecar (MiB)"))
    for ax, field, unit, label in panels:
        for phase, style in zip(PHASES, ("o-", "s--", "^:")):
            ms = [r["phases"][phase]["summary"][field] for r in rows]
            mean = [m["mean"] / unit for m in ms]
            err = [[(m["mean"] - m["min"]) / unit for m in ms], [(m["max"] - m["mean"]) / unit for m in ms]]
            ax.errorbar(pods, mean, yerr=err, fmt=style, capsize=3, label=phase)
        ax.set_xlabel("pods")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0][0].set_title(f"descriptors: {report['descriptors']['order']}")
    axes[0][1].set_title("threads")
    axes[1][0].set_title("memory")
    ax = axes[1][1]
    ax.plot(pods, [r["join"]["handshakes"]["accepted"] / r["pods"] for r in rows], "o-",
            label="handshakes counted per sidecar")
    ax.plot(pods, [r["phases"]["joined"]["summary"]["data_linked_peers"]["mean"] for r in rows], "s--",
            label="peers with data lanes (joined)")
    ax.set_xlabel("pods")
    ax.set_ylabel("per sidecar")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(pods, [r["join"]["settled_seconds"] for r in rows], "r^:", label="seconds until settled")
    twin.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    ax.set_title("mass join")
    fig.suptitle(f"kv-offload bench mesh: real sidecars on one host ({report['host_cpus']} cpus)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
