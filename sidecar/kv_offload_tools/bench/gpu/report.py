"""What `bench gpu` prints and draws of its report: a table per model, the issue's targets
where the run measured them, and a PNG of recompute against the peer hit per prompt length
(one line per lane count, and per sidecar CPU count of ``--sidecar-cpus``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Lane counts the scaling target compares (4 lanes >= 3x one lane).
_SCALING = (1, 4, 3.0)
# Lane count and share of raw TCP with as many streams it must reach (8 lanes >= 0.8x).
_RAW = (8, 0.8)
# Prompt length and speedup the GPU target names (16K tokens: the hit 2x faster).
_SPEEDUP = (16384, 2.0)
# Model the targets are stated for.
_TARGET_MODEL = "llama-3.1-8b"
# Fewest CPUs the lanes' and the speedup's targets hold on (a GPU host; a 2-core host cannot
# give lanes cores).
_TARGET_CPUS = 8
# Most a store (not paced) may take to land in the holder, in memcpys of its bytes.
_STORE_MEMCPY = 2.5
# Most milliseconds the fetcher's p99 /healthz answer may take while chunks arrive.
_HEALTHZ_P99_MS = 10.0
# Fewest bytes a store or a hit moves for its target to apply (the 1 GiB: smaller
# ones are the local channel's fixed costs more than copies).
_TARGET_BYTES = 1 << 30


def setting(entry: Mapping[str, Any]) -> str:
    """A pool's or hit's sidecar setting in words: "lanes 8", or "lanes default, 2 CPUs each"."""
    cpus = entry.get("sidecar_cpus")
    return f"lanes {entry['lanes']}" + ("" if cpus is None else f", {cpus} CPUs each")


def store_ratio(pool: Mapping[str, Any]) -> float:
    """A pool's store: seconds until it landed in the holder over a memcpy of its bytes."""
    return pool["store_landed_s"] / pool["store_memcpy_s"]


def targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's `bench gpu` targets this run measured: the store's and the event loop's on
    any host, the lanes' and the speedup's on a host with 8 or more CPUs."""
    out: list[dict[str, Any]] = []
    for model in report["models"]:
        for pool in model["pools"]:
            if not pool["store_paced"] and pool["store_bytes"] >= _TARGET_BYTES:
                value = store_ratio(pool)
                out.append({"target": f"an unpaced store lands in the holder within {_STORE_MEMCPY:g}x a "
                                      f"memcpy of its bytes ({setting(pool)})",
                            "tokens": max(r["tokens"] for r in model["rows"]), "value": value,
                            "limit": _STORE_MEMCPY, "met": value <= _STORE_MEMCPY})
        for row in model["rows"]:
            for p in row["peer"]:
                if row["kv_bytes"] >= _TARGET_BYTES and p.get("healthz_p99_ms") is not None:
                    out.append({"target": f"the fetcher answers /healthz with p99 <= {_HEALTHZ_P99_MS:g} ms "
                                          f"while {row['kv_bytes'] / 2**30:.2g} GiB arrive ({setting(p)})",
                                "tokens": row["tokens"], "value": p["healthz_p99_ms"],
                                "limit": _HEALTHZ_P99_MS, "met": p["healthz_p99_ms"] <= _HEALTHZ_P99_MS})
    if report["cpus"] < _TARGET_CPUS:
        return out
    for model in report["models"]:
        if model["geometry"]["name"] != _TARGET_MODEL:
            continue
        one, many, ratio = _SCALING
        for row in model["rows"]:  # the lanes' targets: sidecars on half the CPUs each
            peer = [p for p in row["peer"] if p.get("sidecar_cpus") is None]
            row = {**row, "peer": peer}
            by_lanes = {p["lanes"]: p for p in peer}
            if one in by_lanes and many in by_lanes:
                value = by_lanes[many]["fetch_gbps"] / by_lanes[one]["fetch_gbps"]
                out.append({"target": f"{many} lanes >= {ratio:g}x the rate of {one} lane",
                            "tokens": row["tokens"], "value": value, "limit": ratio, "met": value >= ratio})
            if _RAW[0] in by_lanes and row["tokens"] == _longest(model["rows"], _RAW[0]):
                value = by_lanes[_RAW[0]]["ratio_to_raw_tcp"]
                out.append({"target": f"{_RAW[0]} lanes >= {_RAW[1]:g}x raw TCP with {_RAW[0]} streams",
                            "tokens": row["tokens"], "value": value, "limit": _RAW[1], "met": value >= _RAW[1]})
            if row["tokens"] == _SPEEDUP[0] and row["peer"] and row["recompute_s"]:
                best = max(row["peer"], key=lambda p: p["speedup"] or 0)
                out.append({"target": f"peer hit >= {_SPEEDUP[1]:g}x faster than recompute",
                            "tokens": row["tokens"], "lanes": best["lanes"], "value": best["speedup"],
                            "limit": _SPEEDUP[1], "met": best["speedup"] >= _SPEEDUP[1]})
    return out


def _longest(rows: Sequence[Mapping[str, Any]], lanes: int) -> int | None:
    """Tokens of the longest prompt with a hit at ``lanes`` lanes (sidecars on half the CPUs)."""
    measured = [r["tokens"] for r in rows
                if any(p["lanes"] == lanes and p.get("sidecar_cpus") is None for p in r["peer"])]
    return measured[-1] if measured else None


def _lanes_column(p: Mapping[str, Any]) -> str:
    return str(p["lanes"]) if p.get("sidecar_cpus") is None else f"{p['sidecar_cpus']}cpu"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def table(report: Mapping[str, Any]) -> str:
    """The report as text: one block per model, one line per length and lane setting."""
    lines = [f"bench gpu on {report['device']} (torch {report['torch']}, transformers "
             f"{report['transformers']}), plane {report['plane']}, {report['cpus']} CPUs: holder "
             f"sidecar on CPUs {report['pinning']['holder']}, fetcher on {report['pinning']['fetcher']}"]
    for model in report["models"]:
        g = model["geometry"]
        lines.append("")
        lines.append(f"{g['name']}: {g['kv_bytes_per_token'] // 1024} KiB of KV per token, chunks of "
                     f"{g['tokens_per_chunk']} tokens ({g['chunk_bytes'] / 2**20:.1f} MiB); recompute on "
                     f"{model['prefill_layers_timed']} of {g['layers']} layers"
                     + (f" x{model['layer_scale']:g}" if model["layer_scale"] != 1 else ""))
        lines.append(f"{'tokens':>7} {'KV MiB':>8} {'recompute ms':>12} {'break-even':>10}  {'lanes':>7} "
                     f"{'hit ms':>8} {'lookup':>7} {'1st chunk':>9} {'fetch':>8} {'h2d':>7} {'GB/s':>6} "
                     f"{'x raw':>5} {'speedup':>7} "
                     f"{'CPU s/GB holder/fetcher':>23}")
        for row in model["rows"]:
            head = (f"{row['tokens']:>7} {row['kv_bytes'] / 2**20:>8.1f} {_ms(row['recompute_s']):>12} "
                    f"{_gbps(row['breakeven_gbps']):>10}")
            if not row["peer"]:
                lines.append(f"{head}  {row.get('peer_skipped', '')}")
            for p in row["peer"]:
                lines.append(
                    f"{head}  {_lanes_column(p):>7} {_ms(p['hit_s']):>8} {_ms(p['lookup_s']):>7} "
                    f"{_ms(p.get('first_chunk_s')):>9} "
                    f"{_ms(p['fetch_s']):>8} {_ms(p['h2d_s']):>7} {p['fetch_gbps']:>6.2f} "
                    f"{p['ratio_to_raw_tcp']:>5.2f} {_speedup(p['speedup']):>7} "
                    f"{p['holder_cpu_s_per_gb']:>11.2f}/{p['fetcher_cpu_s_per_gb']:<11.2f}"
                    f"{'' if p['identical'] else ' BYTES DIFFER'}{'' if p['all_loaded'] else ' MISSED'}")
                head = " " * len(head)
        for pool in model["pools"]:
            raw = pool["raw_tcp"]
            used = "" if pool["lanes_in_use"] is None else f" ({pool['lanes_in_use']} in use)"
            lines.append(f"{setting(pool)}{used}: stored {pool['store_bytes'] / 2**20:.0f} MiB "
                         f"{'paced' if pool['store_paced'] else 'unpaced'}, landed in the holder in "
                         f"{pool['store_landed_s'] * 1e3:.0f} ms = {store_ratio(pool):.2f}x a memcpy of its "
                         f"bytes ({pool['store_memcpy_s'] * 1e3:.0f} ms), seen by the fetcher after "
                         f"{pool['store_s'] * 1e3:.0f} ms; raw TCP with "
                         f"{raw['streams']} streams, same pinning: {raw['gbps']:.2f} GB/s, CPU s/GB "
                         f"sender {raw['sender_cpu_s_per_gb']:.2f} receiver {raw['receiver_cpu_s_per_gb']:.2f}")
    for t in report.get("targets", []):
        lines.append(f"[target] {t['target']} at {t['tokens']} tokens: {t['value']:.2f} (limit {t['limit']:g}) "
                     f"{'met' if t['met'] else 'NOT met'}")
    return "\n".join(line.rstrip() for line in lines)


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GB/s"


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def plot(report: Mapping[str, Any], path: str) -> None:
    """PNG: per model, recompute and the peer hit (one line per lane setting) against tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models: Sequence[Mapping[str, Any]] = report["models"]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6.5 * max(1, len(models)), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in model["rows"] if r["recompute_s"] is not None]
        ax.plot([r["tokens"] for r in rows], [r["recompute_s"] for r in rows], "k-o", label="recompute")
        settings = sorted({setting(p) for r in model["rows"] for p in r["peer"]})
        for label in settings:
            points = [(r["tokens"], p["hit_s"]) for r in model["rows"] for p in r["peer"] if setting(p) == label]
            ax.plot([t for t, _ in points], [s for _, s in points], "o--",
                    label=f"peer hit, {label}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("seconds")
        ax.set_title(f"{model['geometry']['name']} on {report['device']}, {report['plane']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
