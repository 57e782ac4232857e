"""The README's results table, every figure in it read from a bench's newest record.

Each row names the bench, the table and the cells it quotes (``ROWS``); a record whose
table lacks a row or column a README row quotes is an error naming both, so a bench
whose output changes shape fails ``--check`` instead of leaving a stale row.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kv_offload_tools.bench_records.prose import record_for

Record = dict[str, Any]


def _plain(cell: str) -> str:
    return cell.replace("**", "").strip()


def _table(record: Record, table: int) -> dict[str, Any]:
    tables = record.get("tables", [])
    if not 1 <= table <= len(tables):
        raise KeyError(f"{record['bench']} record {record['date']} has {len(tables)} tables, the README quotes "
                       f"table {table}: name the bench's tables in its record.py (bench_records/shape.py)")
    return tables[table - 1]


def cell(record: Record, table: int, match: dict[str, str], column: str) -> str:
    """The cell in ``column`` of the row of table ``table`` (from 1) whose cells equal ``match``
    (bold marks ignored)."""
    t = _table(record, table)
    cols = [_plain(c) for c in t["columns"]]
    where = f"{record['bench']} record {record['date']}, table {table} ({t.get('title', '')})"
    for name in [*match, column]:
        if name not in cols:
            raise KeyError(f"{where}: no column {name!r}; columns: {cols}")
    for row in t["rows"]:
        if all(_plain(row[cols.index(k)]) == v for k, v in match.items()):
            return _plain(row[cols.index(column)])
    raise KeyError(f"{where}: no row with {match}")


def _seconds(text: str) -> float:
    m = re.match(r"([\d.]+) s$", text)
    if not m:
        raise ValueError(f"{text!r} is not a time in seconds ('0.354 s')")
    return float(m.group(1))


def _span(values: list[float], digits: int) -> str:
    """``values`` as "low-high s", or one value when they round alike."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{low} s" if low == high else f"{low}-{high} s"


def _with(record: Record, *columns: str) -> int:
    """The number (from 1) of the record's first table with all of ``columns`` (bold marks ignored)."""
    for n, t in enumerate(record.get("tables", []), 1):
        if set(columns) <= {_plain(c) for c in t["columns"]}:
            return n
    raise KeyError(f"{record['bench']} record {record['date']}: no table has the columns {list(columns)} the "
                   "README quotes; name the bench's tables in its record.py (bench_records/shape.py)")


def _ttft(r: Record) -> str:
    n = _with(r, "plane", "prefix (KV)", "recompute", "peer hit", "own-sidecar hit")
    planes = [row[0] for row in _table(r, n)["rows"]]
    at = {col: [_seconds(cell(r, n, {"plane": p, "prefix (KV)": "512 MiB"}, col)) for p in dict.fromkeys(planes)]
          for col in ("recompute", "peer hit", "own-sidecar hit")}
    met = r.get("figures", {}).get("targets_met")  # recorded runs say it; imported ones in a note
    return (f"recompute {_span(at['recompute'], 1)}; **peer hit {_span(at['peer hit'], 2)}**; "
            f"own-sidecar hit {_span(at['own-sidecar hit'], 2)}" + (f"; {met}" if met else ""))


def _hit_ratio(r: Record) -> str:
    def at(table: int, col: str) -> str:
        return cell(r, table, {"replicas": "8"}, col)
    local = f"{at(1, 'local only').split()[0]} / {at(2, 'local only').split()[0]}"
    return (f"**{at(1, 'P2P / pooled')}x** on conversations, **{at(2, 'P2P / pooled')}x** on the "
            f"Mooncake trace; local-only caches {local}")


def _by(r: Record, table: int, key: str) -> Callable[[str, str], str]:
    """``at(value, column)``: the cell in ``column`` of table ``table``'s row whose ``key`` is ``value``."""
    return lambda value, column: cell(r, table, {key: value}, column)


def _routing(r: Record) -> str:
    at = _by(r, 3, "routing")
    return (f"a hit moves **{at('prefix-hint', 'bytes moved per hit')}** between pods against "
            f"{at('round-robin', 'bytes moved per hit')} round-robin, at hit ratio "
            f"{at('prefix-hint', 'kv-offload P2P')} against {at('round-robin', 'kv-offload P2P')}")


def _scale(r: Record) -> str:
    at = _by(r, 1, "pods")
    return (f"location memory per sidecar **{at('1,024', 'location memory / sidecar')}** at 1,024 pods "
            f"({at('16', 'location memory / sidecar')} at 16); control traffic "
            f"{at('1,024', 'control traffic / pod (in + out)')} per pod")


def _gpu(r: Record) -> str:
    def at(col: str) -> str:
        return cell(r, 1, {"Llama-3.1-8B": "16K (2 GiB)"}, col)
    hit = at("8 lanes")
    return (f"recompute {at('recompute')}; **peer hit {hit.split(' (')[0]} ({at('speedup (8 lanes)')} faster, "
            f"{hit.split(' (')[1].rstrip(')')})** into vLLM-shaped GPU KV cache")


def _transport(r: Record) -> str:
    def at(method: str) -> str:
        return cell(r, 1, {"chunk": "16 MiB", "method": method}, "x raw TCP")
    return (f"TCP **{at('kv-offload TCP')}x** raw TCP, UCX shared memory "
            f"**{at('kv-offload UCX sm (default, one lane)')}x** (two lanes {at('kv-offload UCX sm, two lanes')}x)")


def _chaos(r: Record) -> str:
    figures = r.get("figures", {})
    if "invariants" not in figures or "fuzz" not in figures:
        raise KeyError(f"chaos record {r['date']}: the README's reliability row quotes its figures 'invariants' "
                       f"and 'fuzz'; it has {sorted(figures)}")
    return f"**{figures['invariants']}**; fuzzing {figures['fuzz']}"


# (bench, what was measured, the figures from its record, where the method is explained); the
# bench's newest record, or with @DATE that run's (a row that needs two kinds of run at once)
ROWS: tuple[tuple[str, str, Callable[[Record], str], str], ...] = (
    ("vllm", "TTFT of a 512 MiB prefix (vLLM CPU build, one core)", _ttft,
     "docs/benchmarks.md#time-to-first-token-inside-vllm"),
    ("replay", "Pool hit ratio vs. one LRU cache of the same total size (8 replicas, round-robin)", _hit_ratio,
     "docs/benchmarks.md#hit-ratio-where-it-matters-one-copy-per-chunk-fetch-or-recompute-routing-hints"),
    ("replay", "Routing hints (`/v1/route`), 8 replicas, conversations", _routing,
     "docs/benchmarks.md#hit-ratio-where-it-matters-one-copy-per-chunk-fetch-or-recompute-routing-hints"),
    ("scale", "Chunk directory at 1,024 pods x 100k chunks", _scale,
     "docs/benchmarks.md#a-pool-of-1000-pods-where-is-what-that-stays-small"),
    ("gpu", "Peer hit on an **H200**, Llama-3.1-8B, 16K tokens (2 GiB of KV, tcp over loopback, 8 lanes)", _gpu,
     "docs/benchmarks.md#a-peer-hit-on-a-gpu-kv-offload-bench-gpu"),
    ("transport", "Transfer rate, 16 MiB chunks, checksums verified, holder and fetcher on a core each",
     _transport, "docs/benchmarks.md#performance"),
    ("chaos@2026-11-29", "Fault injection (kills, flips, truncations, floods) and fuzzed messages", _chaos,
     "docs/explanation/reliability.md"),
)
def results_md(newest: dict[str, Record], directory: Path, page: Path) -> str:
    """The results table: one row per ``ROWS`` entry from ``newest`` (bench -> its newest
    record) or the run it names; links relative to ``page``."""
    def rel(target: str) -> str:
        path, _, anchor = target.partition("#")
        out = os.path.relpath(_repo(directory) / path, page.parent)
        return out + (f"#{anchor}" if anchor else "")

    lines = ["| what | measured | run, method |", "|---|---|---|"]
    for bench, what, figures, method in ROWS:
        if bench.partition("@")[0] not in newest:
            raise KeyError(f"README row {what!r} quotes bench {bench!r}, which has no record in {directory}")
        r = record_for(bench, directory, newest, f"README row {what!r}")
        text = figures(r)
        if r.get("notes", {}).get("readme"):
            text += f" ({r['notes']['readme']})"
        record_page = os.path.relpath(Path(directory) / Path(r["path"]).with_suffix(".md"), page.parent)
        lines.append(f"| {what} | {text} | [{r['date']}]({record_page}), [method]({rel(method)}) |")
    return "\n".join(lines)


def _repo(directory: Path) -> Path:
    """The repository root of a records directory (``<repo>/docs/benchmarks``)."""
    return Path(directory).resolve().parents[1]
