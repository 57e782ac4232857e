"""Markdown rendered from bench records: a record's page, and the blocks other pages hold.

A page holds rendered blocks between markers, everything else in it is written by hand:

- ``<!-- bench:NAME table:N -->`` ... ``<!-- /bench -->``: table N (from 1) of NAME's newest record
  (``bench:NAME@DATE table:N``: of that run's record, for a table the prose says one run made);
- ``<!-- bench:index -->`` ... ``<!-- /bench -->``: one row per bench, its newest record and every run;
- ``<!-- bench:results -->`` ... ``<!-- /bench -->``: the README's results table (``readme.py``).

- ``<!-- figure:... -->`` and ``<!-- figures:... -->``: figures quoted in prose (``prose.py``).

``render_blocks`` replaces what is between each pair and leaves the markers, so rendering a
rendered page changes nothing. ``expected`` renders README.md, docs/benchmarks.md and every
other page under docs/ that holds a marker.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kv_offload_tools import bench_records as records

_BLOCK = re.compile(r"(<!-- bench:(?P<what>[a-z0-9_-]+(?:@[\d-]+)?)(?: table:(?P<table>\d+))? -->\n)(?P<body>.*?)"
                    r"(<!-- /bench -->)", re.S)


def table_md(table: dict[str, Any]) -> str:
    """A table as markdown: header, alignment row, rows; an empty cell is one space."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"
    align = table.get("align") or ["---"] * len(table["columns"])
    return "\n".join([line(table["columns"]), "|" + "|".join(align) + "|", *(line(r) for r in table["rows"])])


def host_line(host: dict[str, Any]) -> str:
    """The host in one line: what the page said of it, or its measured facts."""
    if host.get("description"):
        return str(host["description"])
    parts = [f"{host.get('cores', '?')} cores ({host.get('usable_cores', '?')} usable)"]
    parts += [str(host[k]) for k in ("cpu_model", "gpu") if host.get(k)]
    if host.get("memory_gib"):
        parts.append(f"{host['memory_gib']} GiB")
    if host.get("platform"):
        parts.append(str(host["platform"]))
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def record_page(record: dict[str, Any]) -> str:
    """The page of one record: when, where, what ran, then its figures."""
    name = f"{record['bench']}, {record['date']}"
    commit = record.get("commit") or "unknown"
    rows = [["measured", record["date"]], ["commit", f"`{commit}`"],
            ["host", _cell(host_line(record.get("host", {})))],
            ["command", f"`{_cell(record.get('command', ''))}`" if record.get("command") else "-"]]
    if record.get("imported"):
        rows.append(["imported", _cell(f"typed into {record['imported']} before records existed; "
                                       "the run's host facts and raw output were not kept")])
    lines = [f"# Bench record: {name}", "",
             "Rendered from the JSON beside it by `python -m kv_offload_tools.bench_records --write`; "
             "methods and what the figures mean: [docs/benchmarks.md](../../benchmarks.md).", "",
             table_md({"columns": ["", ""], "rows": rows}), ""]
    for i, table in enumerate(record.get("tables", []), 1):
        lines += [f"## {table.get('title') or f'Table {i}'}", ""]
        if table.get("imported"):
            lines += [f"Typed into {table['imported']} before records held it.", ""]
        lines += [table_md(table), ""]
    if not record.get("tables") and record.get("report") is not None:
        lines += ["This bench names no tables yet (its `record.py`, `bench_records/shape.py`): its "
                  "figures are the `report` in the JSON beside this page.", ""]
    if record.get("output"):
        lines += ["## Output", "", "```text", record["output"].rstrip("\n"), "```", ""]
    if record.get("figures"):
        lines += ["## Figures quoted in prose", ""]
        for key, value in record["figures"].items():
            shown = "; ".join(value) if isinstance(value, list) else value
            lines.append(f"- `{key}`: {shown}")
            if record.get("figures_imported", {}).get(key):
                lines.append(f"  (typed into {record['figures_imported'][key]} before records held it)")
        lines.append("")
    for where, note in sorted(record.get("notes", {}).items()):
        lines += [f"Note ({where}): {note}", ""]
    return "\n".join(lines)


def index_md(directory: Path, page: Path) -> str:
    """One row per bench: its newest run, the host, and every run's page (links relative to ``page``)."""
    rows = []
    for bench in records.benches(directory):
        paths = records.record_paths(directory, bench)
        newest = records.load(paths[-1])
        link = lambda p: os.path.relpath(p.with_suffix(".md"), page.parent)  # noqa: E731
        runs = ", ".join(f"[{p.stem}]({link(p)})" for p in reversed(paths))
        how = "imported" if newest.get("imported") else "recorded"
        rows.append([f"`{bench}`", newest["date"], how, _cell(host_line(newest.get("host", {}))), runs])
    return table_md({"columns": ["bench", "newest run", "how", "host", "runs (JSON beside each page)"],
                     "rows": rows})


def render_blocks(text: str, directory: Path, page: Path) -> str:
    """``text`` with every marked block rendered from the records in ``directory``."""
    from kv_offload_tools.bench_records.prose import record_for, render_figures
    from kv_offload_tools.bench_records.readme import results_md

    newest = records.latest(directory)

    def body(m: re.Match[str]) -> str:
        what, table = m.group("what"), m.group("table")
        if what == "index":
            return index_md(directory, page)
        if what == "results":
            return results_md(newest, directory, page)
        if what.partition("@")[0] not in newest:
            raise KeyError(f"{page.name}: block bench:{what} names no bench with a record in {directory}; "
                           f"benches: {sorted(newest)}")
        record = record_for(what, directory, newest, f"{page.name}: block bench:{what}")
        tables = record.get("tables", [])
        n = int(table or 1)
        if not 1 <= n <= len(tables):
            raise KeyError(f"{page.name}: block bench:{what} table:{n}: the record "
                           f"({record['path']}) has {len(tables)} tables")
        return table_md(tables[n - 1])

    text = _BLOCK.sub(lambda m: m.group(1) + body(m) + "\n" + m.group(5), text)
    return render_figures(text, directory, newest, page.name)


def expected(directory: Path = records.RECORDS_DIR, repo: Path = records.REPO) -> dict[Path, str]:
    """Every rendered file and the text its records render: each record's page, the
    benchmarks page and the README."""
    out = {}
    for bench in records.benches(directory):
        for path in records.record_paths(directory, bench):
            out[path.with_suffix(".md")] = record_page(records.load(path))
    pages = [repo / "docs" / "benchmarks.md", repo / "README.md"]
    pages += [p for p in sorted((repo / "docs").rglob("*.md")) if p not in pages and Path(directory) not in p.parents
              and re.search(r"<!-- (?:bench|figures?):", p.read_text())]
    for page in pages:
        out[page] = render_blocks(page.read_text(), directory, page)
    return out
