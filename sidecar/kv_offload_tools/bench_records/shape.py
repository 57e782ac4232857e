"""A bench's report as a record's tables and named figures, written once for every bench.

A bench names what its record shows in ``kv_offload_tools/bench/<folder>/record.py`` (a bench
of one module: ``bench/<name>_record.py``; ``RECORD_MODULES``): one
``FIGURES = Figures(...)`` of

- ``tables``: each a ``Table`` (a title, the report's rows it shows, and per column a header
  and the cell of one row), or a function from the report to ready tables (for a bench that
  already prints markdown: ``markdown_tables``);
- ``figures``: name -> a function from the report to the text a prose marker quotes
  (``<!-- figure:BENCH.NAME -->``, ``prose.py``), or None where this run did not measure it.

A table without rows (a scenario this run left out) is left out of the record.

``convert(bench, report)`` is what ``kv-offload bench NAME --record DIR`` stores (the record's
``tables`` and ``figures``); a bench without a ``record.py`` gets neither, its record keeps
the report. A cell or figure the report cannot give is an error naming the bench, the table or
figure and the missing key, raised by ``convert`` and kept in the record's ``notes`` by the
recorder, so a run is never lost to a renamed key.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Report = Mapping[str, Any]
TableDict = dict[str, Any]

# bench name -> the module under kv_offload_tools/bench/ that names its figures: its folder's
# record.py, or <bench>_record.py beside a bench of one module.
RECORD_MODULES = {
    "transport": "transport.record",
    "gpu": "gpu.record",
    "vllm": "vllm_ttft.record",
    "replay": "replay.record",
    "scale": "scale.record",
    "mesh": "mesh.record",
    "netns": "netns.record",
    "chaos": "chaos_record",
}


@dataclass(frozen=True)
class Column:
    # The column's header as the page prints it.
    header: str
    # The cell of one row of the report, as the page prints it.
    cell: Callable[[Any], str]


@dataclass(frozen=True)
class Table:
    # The table's title on the record's page.
    title: str
    # The report's rows this table shows, one table row each.
    rows: Callable[[Report], Iterable[Any]]
    # The columns, left to right.
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class Figures:
    # The record's tables, in order: a Table, or a function from the report to ready tables.
    tables: tuple[Table | Callable[[Report], list[TableDict]], ...] = ()
    # Named figures for prose markers: name -> the text from the report (None: not measured).
    figures: Mapping[str, Callable[[Report], str | None]] = field(default_factory=dict)


def key(*path: str | int, fmt: str = "{}") -> Callable[[Any], str]:
    """A cell: the value at ``path`` in a row (dict keys, list indexes), formatted with ``fmt``."""

    def cell(row: Any) -> str:
        value = row
        for step in path:
            value = value[step]
        return fmt.format(value)

    return cell


def keyed(*pairs: tuple[str, str]) -> tuple[Column, ...]:
    """Columns that print a row's value as it is: ``(header, the row's key)`` each."""
    return tuple(Column(header, key(name)) for header, name in pairs)


def markdown_tables(text: str, title: str = "") -> list[TableDict]:
    """The markdown tables in ``text`` (a bench's printed output), titled ``title`` and a number."""
    out: list[TableDict] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: "):
            block = [lines[i], lines[i + 1]]
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in block]
            out.append(
                {
                    "title": f"{title}: table {len(out) + 1}" if title else f"Table {len(out) + 1}",
                    "columns": cells[0],
                    "align": [c or "---" for c in cells[1]],
                    "rows": cells[2:],
                }
            )
        else:
            i += 1
    return out


def spec(bench: str) -> Figures | None:
    """What ``bench`` names for its record, or None for a bench without a ``record.py``."""
    module = RECORD_MODULES.get(bench)
    if module is None:
        return None
    return importlib.import_module(f"kv_offload_tools.bench.{module}").FIGURES


def _table(bench: str, t: Table, report: Report) -> TableDict:
    rows = []
    for n, row in enumerate(t.rows(report)):
        cells = []
        for c in t.columns:
            try:
                cells.append(c.cell(row))
            except (KeyError, IndexError, TypeError) as exc:
                raise KeyError(
                    f"bench {bench}: table {t.title!r}, column {c.header!r}, row {n + 1}: the report has no {exc}"
                ) from exc
        rows.append(cells)
    return {"title": t.title, "columns": [c.header for c in t.columns], "align": ["---"] * len(t.columns), "rows": rows}


def convert(bench: str, report: Report | None) -> dict[str, Any]:
    """``{"tables": [...], "figures": {...}}`` of ``bench``'s report, as its record keeps them."""
    figures = spec(bench)
    if figures is None or not isinstance(report, Mapping):
        return {"tables": [], "figures": {}}
    tables: list[TableDict] = []
    for t in figures.tables:
        tables += [_table(bench, t, report)] if isinstance(t, Table) else t(report)
    named = {}
    for name, figure in figures.figures.items():
        try:
            value = figure(report)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise KeyError(f"bench {bench}: figure {name!r}: the report has no {exc}") from exc
        if value is not None:
            named[name] = value
    return {"tables": [t for t in tables if t["rows"]], "figures": named}
