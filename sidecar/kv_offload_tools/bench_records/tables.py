"""Tables that take more than a column per report key: bench transport's (a method's label
holds raw TCP's rate with as many streams) and bench gpu's (a column per lane count run).
Their benches name them in their ``record.py`` (``shape.py``).
"""

from __future__ import annotations

from typing import Any

Table = dict[str, Any]

# bench transport's method names as its figures table has always named them.
TRANSPORT_LABELS = {
    "raw_tcp": "raw TCP", "memcpy": "memcpy (one core)", "tcp": "kv-offload TCP",
    "tcp+tls": "kv-offload TCP under TLS", "tcp_2lanes": "kv-offload TCP, 2 lanes",
    "tcp_4lanes": "kv-offload TCP, 4 lanes", "tls_2lanes": "kv-offload TCP under TLS, 2 lanes",
    "ucx_sm": "kv-offload UCX sm (default, one lane)", "ucx_sm_2lanes": "kv-offload UCX sm, two lanes",
    "ucx_sm_limit": "bare ucxx, two lanes, verified (limit)",
    "ucx_sm_tagsend": "bare ucxx tag send/recv, one lane, unverified", "ucx_tcp": "kv-offload UCX tcp",
    "aiohttp_get": "aiohttp, one GET per chunk", "nixl": "kv-offload NIXL, verified",
    "nixl_unverified": "kv-offload NIXL, unverified", "nixl_bare": "bare NIXL READ, one agent",
}
# Rows shown inside another row's label instead: raw TCP with N streams, beside N lanes.
_STREAMS_IN_LABEL = {"tcp_2lanes": ("raw_tcp_2streams", 2), "tcp_4lanes": ("raw_tcp_4streams", 4)}


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def transport(report: dict[str, Any]) -> list[Table]:
    """GB/s, ratio to raw TCP and CPU per GB of each method and chunk size."""
    results = report.get("results", [])
    gbps = {(r["method"], r["chunk_bytes"]): r["gbps_median"] for r in results}
    hidden = {twin for twin, _ in _STREAMS_IN_LABEL.values()}
    rows = []
    for r in results:
        method, size = r["method"], r["chunk_bytes"]
        if method in hidden:
            continue
        label = TRANSPORT_LABELS.get(method, method)
        twin, streams = _STREAMS_IN_LABEL.get(method, ("", 0))
        if (twin, size) in gbps:
            label += f" (raw TCP, {streams} streams: {gbps[(twin, size)]:.2f})"
        holder = "-" if method == "memcpy" else f"{r['holder_cpu_seconds_per_gb']:.2f}"
        rows.append([_size(size), label, f"{r['gbps_median']:.2f}", f"{r['ratio_to_raw_tcp']:.2f}",
                     f"{holder} / {r['fetcher_cpu_seconds_per_gb']:.2f}"])
    return [{"title": "Performance", "columns": ["chunk", "method", "GB/s (median)", "x raw TCP",
                                                 "CPU-s/GB holder / fetcher"],
             "align": ["---"] * 5, "rows": rows}]


# bench gpu's model names as the docs spell them.
GPU_MODEL_NAMES = {"llama-3.1-8b": "Llama-3.1-8B"}


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _tokens(row: dict[str, Any]) -> str:
    tokens, kv = row["tokens"], row["kv_bytes"]
    size = f"{kv / 2**30:g} GiB" if kv >= 1 << 30 else f"{kv / 2**20:g} MiB"
    return f"{tokens // 1024}K ({size})" if tokens % 1024 == 0 else f"{tokens} ({size})"


def gpu(report: dict[str, Any]) -> list[Table]:
    """Per model: recompute against the peer hit with each lane count, per prompt length."""
    out = []
    for model in report.get("models", []):
        name = GPU_MODEL_NAMES.get(model["geometry"]["name"], model["geometry"]["name"])
        lanes = sorted({p["lanes"] for r in model["rows"] for p in r["peer"] if p.get("sidecar_cpus") is None})
        if not lanes:
            continue
        most = lanes[-1]
        columns = [name, "recompute", *(f"peer hit, {n} lane{'s' * (n > 1)}" if i == 0 else f"{n} lanes"
                                        for i, n in enumerate(lanes)), f"speedup ({most} lanes)"]
        rows = []
        for r in model["rows"]:
            by_lanes = {p["lanes"]: p for p in r["peer"] if p.get("sidecar_cpus") is None}
            hits = [f"{_time(by_lanes[n]['hit_s'])} ({by_lanes[n]['fetch_gbps']:.1f} GB/s)" if n in by_lanes
                    else "" for n in lanes]
            speedup = by_lanes.get(most, {}).get("speedup")
            rows.append([_tokens(r), _time(r.get("recompute_s")), *hits,
                         "" if speedup is None else f"{speedup:.2f}x"])
        out.append({"title": f"A peer hit on a GPU: {name}", "columns": columns, "align": ["---"] * len(columns),
                    "rows": rows})
    return out
