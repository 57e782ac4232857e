"""The report of ``kv-offload bench transport``: targets, ceilings, TLS's cost, the table and the plot."""

from __future__ import annotations

import os
from typing import Any

from kv_offload_tools.bench.quantile import quantile
from kv_offload_tools.bench.transport.methods import LANE_LADDER, LOOKUP_KEYS, METHODS, ONE_LANE

# Targets: (description, method, chunk sizes, baseline, minimum ratio of their GB/s).
TARGETS = (
    ("TCP transport >= 0.8x raw TCP", "tcp", (2097152,), "raw_tcp", 0.8),
    ("TCP transport >= 0.9x raw TCP (one stream, holder and fetcher on CPUs of their own)", "tcp",
     (16777216,), "raw_tcp", 0.9),
    ("UCX sm >= 2.0x raw TCP", "ucx_sm", (2097152, 16777216), "raw_tcp", 2.0),
    ("UCX sm, two lanes >= 2.0x raw TCP", "ucx_sm_2lanes", (2097152, 16777216), "raw_tcp", 2.0),
    ("UCX sm >= 3x one-GET-per-chunk aiohttp", "ucx_sm", (2097152,), "aiohttp_get", 3.0),
    ("TCP transport >= 1.5x one-GET-per-chunk aiohttp", "tcp", (2097152,), "aiohttp_get", 1.5),
    ("NIXL peer fetch, verified >= 0.6x memcpy", "nixl", (2097152, 16777216), "memcpy", 0.6),
    ("NIXL peer fetch, unverified >= 0.8x memcpy", "nixl_unverified", (2097152, 16777216), "memcpy", 0.8),
)
# CPU targets: (description, method, chunk sizes, baseline, most CPU-seconds per GB relative to
# it, whose: "both" processes, the "holder"'s (raw TCP's sender) or the "fetcher"'s (its receiver)).
CPU_TARGETS = (
    ("NIXL peer fetch CPU-seconds per GB <= 1/3 of raw TCP's", "nixl", (2097152, 16777216), "raw_tcp", 1 / 3,
     "both"),
    ("TCP fetcher CPU-seconds per GB <= 1.25x raw TCP's receiver", "tcp", (16777216,), "raw_tcp", 1.25,
     "fetcher"),
    ("TCP holder CPU-seconds per GB <= 1.25x raw TCP's sender", "tcp", (16777216,), "raw_tcp", 1.25, "holder"),
)
# CPU-seconds per GB field of a row, by whose.
CPU_FIELDS = {"both": "cpu_seconds_per_gb", "holder": "holder_cpu_seconds_per_gb",
              "fetcher": "fetcher_cpu_seconds_per_gb"}
# Idle target: the most of a core a connected, idle NIXL holder or fetcher process may use.
IDLE_TARGET_SHARE = 0.02
# Target of the lookup: p50 at most this many raw 64-byte TCP round trips.
LOOKUP_TARGET_RATIO = 1.5
# Rows that bound what any data plane can reach here, printed beside the targets.
CEILING_METHODS = ("memcpy", "ucx_sm_limit", "ucx_sm_tagsend", "nixl_bare")


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 (microseconds) of round-trip samples."""
    return {"p50_us": quantile(values, 0.5), "p99_us": quantile(values, 0.99), "samples": len(values)}


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target at each of its chunk sizes measured: the ratio, the one required, met or not."""
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    out = []
    for text, method, sizes, base, need in TARGETS:
        for size in sizes:
            if (method, size) not in by or (base, size) not in by:
                continue
            ratio = by[(method, size)]["ratio_to_raw_tcp"] / by[(base, size)]["ratio_to_raw_tcp"]
            out.append({"target": f"{text} at {fmt_size(size)}", "ratio": ratio, "required": need,
                        "met": ratio >= need})
    for text, method, sizes, base, most, whose in CPU_TARGETS:
        for size in sizes:
            if (method, size) in by and (base, size) in by:
                name = CPU_FIELDS[whose]
                ratio = by[(method, size)][name] / by[(base, size)][name]
                out.append({"target": f"{text} at {fmt_size(size)}", "ratio": ratio, "required": most,
                            "met": ratio <= most, "at_most": True})
    for method, idle in (report.get("idle") or {}).items():
        share = max(idle["holder_core_share"], idle["fetcher_core_share"])
        out.append({"target": f"idle {method} sidecar process < {100 * IDLE_TARGET_SHARE:g}% of a core",
                    "ratio": share, "required": IDLE_TARGET_SHARE, "met": share < IDLE_TARGET_SHARE,
                    "at_most": True})
    lk = report.get("lookup") or {}
    if "ratio_to_raw_rtt" in lk:
        out.append({"target": f"{LOOKUP_KEYS}-key lookup p50 <= {LOOKUP_TARGET_RATIO:g}x raw 64-byte "
                              f"TCP round trip ({lk['transport']})",
                    "ratio": lk["ratio_to_raw_rtt"], "required": LOOKUP_TARGET_RATIO,
                    "met": lk["ratio_to_raw_rtt"] <= LOOKUP_TARGET_RATIO})
    return out


def ceilings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per chunk size, the ratios to raw TCP of the rows that bound the UCX targets: one
    core's memcpy, bare ucxx with both cores copying and verifying, bare tag send/recv."""
    out = []
    for size in sorted({r["chunk_bytes"] for r in report["results"]}):
        ratios = {r["method"]: r["ratio_to_raw_tcp"] for r in report["results"]
                  if r["chunk_bytes"] == size and r["method"] in CEILING_METHODS}
        if ratios:
            out.append({"chunk_bytes": size, "ratios": ratios})
    return out


def tls_overhead(report: dict[str, Any], method: str = "tcp+tls") -> list[dict[str, Any]]:
    """Per chunk size, ``method`` measured against its plain twin (``tcp+tls`` against ``tcp``):
    the median of the per-round ratios of GB/s and of CPU-seconds per GB."""
    return [{"method": r["method"], "compared_to": r["compared_to"], "chunk_bytes": r["chunk_bytes"],
             "throughput_ratio": r["ratio_to_twin"], "cpu_ratio": r["cpu_ratio_to_twin"]}
            for r in report["results"] if "compared_to" in r and r["method"] == method]


def verification_cost(report: dict[str, Any]) -> list[dict[str, Any]]:
    """What integrity costs on the NIXL path: ``nixl`` against ``nixl_unverified`` (same rounds),
    plus the extra CPU-seconds per GB the hashing takes."""
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    out = tls_overhead(report, "nixl")
    for row in out:
        plain = by[("nixl_unverified", row["chunk_bytes"])]["cpu_seconds_per_gb"]
        row["extra_cpu_seconds_per_gb"] = by[("nixl", row["chunk_bytes"])]["cpu_seconds_per_gb"] - plain
    return out


def lanes_scaling(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per laned row: its GB/s against raw TCP with as many streams in the same rounds, and
    against the transport's one lane (``ONE_LANE``)."""
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    out = []
    for (method, size), r in by.items():
        if "streams_twin" not in r:
            continue
        one = by.get((ONE_LANE[method], size))
        out.append({"method": method, "chunk_bytes": size, "compared_to": r["streams_twin"],
                    "one_lane": ONE_LANE[method],
                    "ratio_to_streams": r["ratio_to_streams_twin"],
                    "ratio_to_one_lane": r["gbps_median"] / one["gbps_median"] if one else None})
    return out


def lanes_cpu(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per chunk size and lane count measured (``LANE_LADDER``): the fetcher's CPU-seconds per GB
    against raw TCP's receiver with as many streams, in the same rounds."""
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    out = []
    for size in sorted({r["chunk_bytes"] for r in report["results"]}):
        for lanes, method, raw in LANE_LADDER:
            mine, twin = by.get((method, size)), by.get((raw, size))
            if mine is None or twin is None:
                continue
            f, r = mine["fetcher_cpu_seconds_per_gb"], twin["fetcher_cpu_seconds_per_gb"]
            out.append({"chunk_bytes": size, "lanes": lanes, "method": method, "compared_to": raw,
                        "fetcher_cpu_seconds_per_gb": f, "raw_receiver_cpu_seconds_per_gb": r,
                        "ratio": f / r if r else None})
    return out


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def table(report: dict[str, Any]) -> str:
    """The report as text: GB/s per method and size, lookups, targets, ceilings."""
    lines = [f"{'chunk':>8}  {'method':<16} {'GB/s median':>11}  {'min-max':>13}  {'x raw TCP':>9}  "
             + f"{'CPU s/GB':>8}  {'holder':>6}  {'fetcher':>7}  bytes"]
    for r in report["results"]:
        lines.append(f"{fmt_size(r['chunk_bytes']):>8}  {r['method']:<16} {r['gbps_median']:>11.2f}  "
                     f"{r['gbps_min']:>6.2f}-{r['gbps_max']:<6.2f}  {r['ratio_to_raw_tcp']:>8.2f}x  "
                     f"{r['cpu_seconds_per_gb']:>8.2f}  {r['holder_cpu_seconds_per_gb']:>6.2f}  "
                     f"{r['fetcher_cpu_seconds_per_gb']:>7.2f}  {'identical' if r['identical'] else 'DIFFER'}")
    pins = report.get("pinning")
    if pins:
        lines.append(f"holder (server) processes on CPUs {pins['holder']}, fetchers (clients) on {pins['fetcher']}")
    lk = report.get("lookup") or {}
    if lk:
        lines.append("")
        lines.append(f"raw 64-byte TCP round trip (alternating with the lookups): p50 "
                     f"{lk['raw_rtt_p50_us']:.0f} us, p99 {lk['raw_rtt_p99_us']:.0f} us")
        for m, p in lk.get("by_transport", {}).items():
            lines.append(f"{LOOKUP_KEYS}-key lookup over {m:<8}: p50 {p['p50_us']:6.0f} us, "
                         f"p99 {p['p99_us']:6.0f} us = {p['ratio_to_raw_rtt']:.2f}x raw "
                         f"(raw in that process: {p['raw_rtt_p50_us_alongside']:.0f} us)")
            if "while_fetching" in p:
                w = p["while_fetching"]
                lines.append(f"{LOOKUP_KEYS}-key lookup over {m:<8} while its fetches stream: p50 "
                             f"{w['p50_us']:6.0f} us, p99 {w['p99_us']:6.0f} us")
    if report.get("targets"):
        lines.append("")
        for t in report["targets"]:
            need = f"at most {t['required']:.3g}" if t.get("at_most") else f"required {t['required']:g}x"
            value = f"{t['ratio']:.3g}" if t.get("at_most") else f"{t['ratio']:.2f}x"
            lines.append(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {value} ({need})")
    for c in report.get("ceilings", []):
        parts = ", ".join(f"{m} {c['ratios'][m]:.2f}x" for m in CEILING_METHODS if m in c["ratios"])
        lines.append(f"[ceiling] at {fmt_size(c['chunk_bytes'])} the machine allows: {parts} raw TCP")
    for t in report.get("tls", []):
        lines.append(f"[tls] at {fmt_size(t['chunk_bytes'])}: {t['method']} moves {t['throughput_ratio']:.2f}x "
                     f"the GB/s of {t['compared_to']} at {t['cpu_ratio']:.2f}x its CPU-seconds per GB")
    for v in report.get("verification", []):
        lines.append(f"[verify] at {fmt_size(v['chunk_bytes'])}: nixl (every chunk hashed in cache and checked) "
                     f"moves {v['throughput_ratio']:.2f}x the GB/s of nixl_unverified at {v['cpu_ratio']:.2f}x its "
                     f"CPU-seconds per GB (+{v['extra_cpu_seconds_per_gb']:.3f} CPU-s/GB)")
    for ln in report.get("lanes", []):
        one = ("" if ln["ratio_to_one_lane"] is None
               else f", {ln['ratio_to_one_lane']:.2f}x one lane ({ln['one_lane']})")
        lines.append(f"[lanes] at {fmt_size(ln['chunk_bytes'])}: {ln['method']} moves {ln['ratio_to_streams']:.2f}x "
                     f"the GB/s of {ln['compared_to']}{one}")
    for c in report.get("lanes_cpu", []):
        ratio = "" if c["ratio"] is None else f" = {c['ratio']:.2f}x"
        lines.append(f"[cpu/GB] at {fmt_size(c['chunk_bytes'])}, {c['lanes']} lane{'s' if c['lanes'] > 1 else ''}: "
                     f"fetcher {c['fetcher_cpu_seconds_per_gb']:.2f} CPU-s/GB against raw TCP's receiver "
                     f"{c['raw_receiver_cpu_seconds_per_gb']:.2f} ({c['compared_to']}){ratio}")
    for m, idle in (report.get("idle") or {}).items():
        lines.append(f"[idle] {m}, connected and idle for {idle['seconds']:.1f} s: holder "
                     f"{100 * idle['holder_core_share']:.2f}% of a core, fetcher "
                     f"{100 * idle['fetcher_core_share']:.2f}%")
    if report.get("plot"):
        lines.append(f"\nplot: {report['plot']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """GB/s per method, grouped by chunk size, with the min-max of the rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["chunk_bytes"] for r in report["results"]})
    methods = [m for m in METHODS if any(r["method"] == m for r in report["results"])]
    by = {(r["method"], r["chunk_bytes"]): r for r in report["results"]}
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, s in enumerate(sizes):
            r = by[(m, s)]
            xs.append(i + j * width)
            ys.append(r["gbps_median"])
            lo.append(r["gbps_median"] - r["gbps_min"])
            hi.append(r["gbps_max"] - r["gbps_median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [fmt_size(s) for s in sizes])
    ax.set_xlabel("chunk size")
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_title(f"kv-offload data plane, {report['rounds']} interleaved rounds, "
                 f"{report['cpus']} CPUs")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # clear of the bars
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
