"""The table and the plot of ``kv-offload bench scale``."""

from __future__ import annotations

from typing import Any


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 * 10 else f"{n / 2**30:,.0f} GiB"


def _mbps(n: float) -> str:
    return f"{n / 1e6:,.3f} MB/s" if n < 1e8 else f"{n / 1e6:,.0f} MB/s"


def format_table(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"bench scale: {s['chunks_per_pod']} chunks/pod, {s['changes_per_second']:g} changes/s/pod, "
             f"publish every {s['publish_interval_seconds']:g} s"]
    head = ("pods", "memory/sidecar", "control/pod (in+out)", "msgs/lookup", "msgs/peer-hit req",
            "false pos.", "hit ratio vs exact", "join: joiner gets", "leave: each sends")
    rows = [head]
    for r in report["results"]:
        rows.append((str(r["pods"]), _mib(r["location_bytes_per_sidecar"]),
                     _mbps(r["control_bytes_per_second_per_pod"]), f"{r['messages_per_lookup']:.2f}",
                     f"{r['messages_per_peer_hit_request']:.2f}", f"{r['false_positive_ratio']:.4f}",
                     f"{r['hit_ratio_vs_exact']:.3f}", f"{r['join'].get('joiner_bytes_received', 0) / 1e6:.2f} MB",
                     f"{r['leave'].get('bytes_sent_by_each_member', 0) / 1e3:.1f} kB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("  the alternatives, per sidecar (memory; control bytes/s each way):")
    for r in report["results"]:
        ex, bl = r["alternatives"]["exact"], r["alternatives"]["bloom"]
        lines.append(f"    {r['pods']:>5} pods: exact sets {_mib(ex['memory_bytes'])}, "
                     f"{_mbps(ex['bytes_per_second_each_way'])}; Bloom filters "
                     f"({bl['bits_per_entry']:.1f} bits/entry) {_mib(bl['memory_bytes'])}, "
                     f"{_mbps(bl['bytes_per_second_each_way'])}")
    lines.append("  messages per peer-hit request by holders read in turn (share of those requests):")
    for r in report["results"]:
        lines.append(f"    {r['pods']:>5} pods: " + _holders(r["by_holders"]))
    lines.append("  links per sidecar (data: holders read from / readers served, per idle window; control: "
                 "peers publishing or published to, per keep-alive; worst member, mean):")
    for r in report["results"]:
        k = r["links"]
        out, into = k["holders_read_from_per_window"], k["readers_per_window"]
        lines.append(f"    {r['pods']:>5} pods: data out {out.get('max', 0):.0f} (mean {out.get('mean', 0):.1f}; "
                     f"at most {k['max_data_links']} open), in {into.get('max', 0):.0f} "
                     f"(mean {into.get('mean', 0):.1f}), "
                     f"control {k['publish_peers_per_window'].get('max', 0):.0f} "
                     f"({'within' if k['control_within_bound'] else 'past'} the {k['control_connections']} "
                     f"connections: {k['control_connection_opens_per_second']:.1f} opens/s)")
    if report.get("reads"):
        lines.append("  the read on bench replay's workloads (round-robin):")
        for r in report["reads"]:
            lines.append(f"    {r['workload']:>12} x{r['replicas']:<3} hit ratio {r['hit_ratio']:.3f}, "
                         f"{r['messages_per_request']:.2f} msgs/request, {r['messages_per_peer_hit_request']:.2f} "
                         f"msgs/peer-hit request ({r['all_messages_per_peer_hit_request']:.2f} all msgs/peer-hit "
                         f"request); " + _holders(r["by_holders"]))
    last = report["results"][-1]
    met = [f"{name} {'ok' if ok else 'MISSED'}" for name, ok in last["meets_targets"].items()]
    lines.append(f"  targets at {last['pods']} pods: " + ", ".join(met))
    lines += [f"  note: {n}" for n in report["notes"]]
    if report.get("plot"):
        lines.append(f"  plot: {report['plot']}")
    return "\n".join(lines)


def _holders(by: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{k}: {v['messages_per_request']:.2f} ({100 * v['share']:.0f} %)" for k, v in by.items())


def write_plot(path: str, report: dict[str, Any]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    pods = [r["pods"] for r in rows]
    targets = report["targets"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0][0]
    ax.plot(pods, [r["location_bytes_per_sidecar"] / 2**20 for r in rows], "o-", label="directory (measured)")
    ax.plot(pods, [r["alternatives"]["exact"]["memory_bytes"] / 2**20 for r in rows], "s--",
            label="exact per-peer sets (previous design)")
    ax.plot(pods, [r["alternatives"]["bloom"]["memory_bytes"] / 2**20 for r in rows], "^:",
            label="per-peer Bloom filters, 1% fp/lookup")
    ax.axhline(targets["location_bytes_per_sidecar"] / 2**20, color="red", lw=1, label="target 64 MiB")
    ax.set_yscale("log")
    ax.set_ylabel("location memory per sidecar (MiB)")
    ax.set_title("memory")
    ax = axes[0][1]
    ax.plot(pods, [r["control_bytes_per_second_per_pod"] / 1e6 for r in rows], "o-", label="directory, in+out")
    ax.plot(pods, [r["control_bytes_out_per_second_per_pod"] / 1e6 for r in rows], ".--",
            label="directory, out")
    ax.plot(pods, [2 * r["alternatives"]["exact"]["bytes_per_second_each_way"] / 1e6 for r in rows], "s--",
            label="exact per-peer pulls, in+out")
    ax.plot(pods, [2 * r["alternatives"]["bloom"]["bytes_per_second_each_way"] / 1e6 for r in rows], "^:",
            label="Bloom updates, in+out")
    ax.axhline(targets["control_bytes_per_second_per_pod"] / 1e6, color="red", lw=1, label="target 1 MB/s")
    ax.set_yscale("log")
    ax.set_ylabel("control MB/s per pod")
    ax.set_title("background traffic")
    ax = axes[1][0]
    ax.plot(pods, [r["messages_per_peer_hit_request"] for r in rows], "o-", label="per peer-hit request")
    ax.plot(pods, [r["messages_per_lookup"] for r in rows], "s-", label="per lookup")
    ks = sorted({int(k) for r in rows for k in r["by_holders"]})
    for k in ks:
        ax.plot(pods, [r["by_holders"].get(str(k), {}).get("messages_per_request", float("nan")) for r in rows],
                ":", lw=1.2, color=plt.cm.copper(k / (max(ks) + 1)),
                label=f"requests read from {k} holder{'s' if k > 1 else ''}")
    ax.set_ylim(0, None)
    ax.set_ylabel("messages (directory)")
    twin = ax.twinx()
    twin.plot(pods, [100 * r["false_positive_ratio"] for r in rows], "g^:", label="false-positive lookups %")
    twin.axhline(100 * targets["false_positive_ratio"], color="green", lw=1, ls="--")
    twin.set_ylabel("false-positive peer lookups (%)", color="g")
    twin.set_ylim(0, 2)
    ax.legend(fontsize=8, loc="upper left")
    twin.legend(fontsize=8, loc="upper right")
    ax.set_title("messages and false positives")
    ax = axes[1][1]
    ax.plot(pods, [r["hit_ratio_vs_exact"] for r in rows], "o-", label="directory / exact")
    ax.plot(pods, [r["hit_ratio"] for r in rows], ".--", label="directory hit ratio")
    ax.plot(pods, [r["exact_hit_ratio"] for r in rows], "s:", label="exact hit ratio")
    ax.axhline(targets["hit_ratio_vs_exact"], color="red", lw=1, label="target 0.97")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("hit ratio")
    ax.set_title("hit ratio on the same request stream")
    for a in (axes[0][0], axes[0][1], axes[1][1]):
        a.legend(fontsize=8)
    for a in axes.flat:
        a.set_xscale("log", base=2)
        a.set_xticks(pods)
        a.set_xticklabels([str(p) for p in pods])
        a.set_xlabel("pods")
    s = report["settings"]
    fig.suptitle(f"kv-offload bench scale: {s['chunks_per_pod']} chunks/pod, "
                 f"{s['changes_per_second']:g} changes/s/pod")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
