"""Figures quoted in prose, filled from bench records like the tables are.

Two markers put a record's figures into a page's sentences (``render.py`` fills them):

- ``<!-- figure:REF.KEY -->TEXT<!-- /figure -->``: TEXT is the record's ``figures[KEY]``
  (a string), e.g. ``<!-- figure:replay.hit_ratio_vs_one_lru -->0.98-1.00x<!-- /figure -->``;
- ``<!-- figures:REF.KEY -->`` ... ``<!-- /figures -->`` (each on a line of its own): a
  passage whose figure-looking numbers (``FIGURE``, outside code, links and other markers),
  in order, are the record's ``figures[KEY]`` (a list of strings).

REF is a bench's name (its newest record: the sentence follows every new run, and a run
whose record lacks KEY fails ``--check``) or ``NAME@DATE`` (that run's record, e.g.
``vllm@2026-12-05`` or ``vllm@2026-12-05-2``: prose about one run names the run).

``FIGURE`` is what counts as a measurement in the docs: a number (a sign, thousands commas,
decimals and a range ``a-b`` allowed) followed by a unit of time, size, rate or a ratio
(``x``, ``%``). ``loose_figures`` finds the ones outside every marker and rendered block;
``tests/tools/test_bench_records.py`` fails on any in README.md and docs/benchmarks.md that
``NOT_MEASUREMENTS`` does not list.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kv_offload_tools import bench_records as records

_UNITS = r"x|%|ns|µs|us|ms|s|KiB|MiB|GiB|TiB|KB|MB|GB|TB|GB/s|MB/s|GiB/s|Gbit/s|Mbit/s|kbit/s|CPU-s/GB"
_NUMBER = r"[+-]?\d[\d,]*(?:\.\d+)?"
# A measurement as the docs write one: "1.17x", "0.98-1.00x", "594 ms", "+68.8 ms", "2.64 GB/s".
FIGURE = re.compile(rf"(?<![\w.+/-]){_NUMBER}(?:-{_NUMBER})?\s?(?:{_UNITS})(?![\w/])")
# Text whose numbers are not prose: fenced and inline code, link targets, rendered blocks
# and markers (the figure markers' contents are filled, not read).
_SKIP = re.compile(  # a passage may hold single figures: each marker closes with its own kind
    r"<!-- bench:.*?<!-- /bench -->|<!-- figure:.*?<!-- /figure -->|<!-- figures:.*?<!-- /figures -->"
    r"|```.*?```|`[^`\n]*`"
    r"|<!--.*?-->|\]\([^)\s]*\)",
    re.S,
)
_REF = r"(?P<ref>[a-z0-9_-]+(?:@\d{4}-\d{2}-\d{2}(?:-\d+)?)?)\.(?P<key>[a-z0-9_]+)"
_ONE = re.compile(rf"(<!-- figure: ?{_REF} -->)(?P<body>.*?)(<!-- /figure -->)", re.S)
_PASSAGE = re.compile(rf"(<!-- figures: ?{_REF} -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)
_INNER_SKIP = re.compile(
    r"<!-- bench:.*?<!-- /bench -->|<!-- figure:.*?<!-- /figure -->|```.*?```|`[^`\n]*`"
    r"|<!--.*?-->|\]\([^)\s]*\)",
    re.S,
)

# Figure-looking text in README.md and docs/benchmarks.md that is not a measurement: a
# setting, a size chosen for a run, a limit. Each entry: (the exact text, why).
NOT_MEASUREMENTS: tuple[tuple[str, str], ...] = ()

Record = dict[str, Any]


def _figures(text: str, skip: re.Pattern[str]) -> list[re.Match[str]]:
    out, pos = [], 0
    for m in [*skip.finditer(text), None]:
        end = m.start() if m else len(text)
        out += list(FIGURE.finditer(text, pos, end))
        pos = m.end() if m else len(text)
    return out


def figures_in(passage: str) -> list[str]:
    """The figure-looking numbers of a passage, in order (what ``figures:`` markers fill)."""
    return [m.group(0) for m in _figures(passage, _INNER_SKIP)]


def loose_figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) for every figure-looking number outside markers, blocks, code and links."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in _figures(text, _SKIP)]


def record_for(ref: str, directory: Path, newest: dict[str, Record], where: str) -> Record:
    """The record a marker names: ``NAME`` (its newest) or ``NAME@DATE``."""
    bench, _, date = ref.partition("@")
    if not date:
        if bench not in newest:
            raise KeyError(
                f"{where}: figure marker names bench {bench!r}, which has no record in {directory}; "
                f"benches: {sorted(newest)}"
            )
        return newest[bench]
    path = Path(directory) / bench / f"{date}.json"
    if not path.is_file():
        raise KeyError(f"{where}: figure marker names {ref!r}, and {path} does not exist")
    return {**records.load(path), "path": f"{bench}/{path.name}"}


def _value(r: Record, key: str, where: str, kind: type) -> Any:
    value = r.get("figures", {}).get(key)
    if not isinstance(value, kind):
        raise KeyError(
            f"{where}: record {r['path']} has no {'list' if kind is list else 'text'} figure {key!r}; "
            f"its figures: {sorted(r.get('figures', {}))}"
        )
    return value


def render_figures(text: str, directory: Path, newest: dict[str, Record], where: str) -> str:
    """``text`` with every ``figure:`` and ``figures:`` marker filled from its record."""

    def passage(m: re.Match[str]) -> str:
        at = f"{where}, figures:{m.group('ref')}.{m.group('key')}"
        values = _value(record_for(m.group("ref"), directory, newest, at), m.group("key"), at, list)
        body = m.group("body")
        found = _figures(body, _INNER_SKIP)
        if len(found) != len(values):
            raise ValueError(
                f"{at}: the passage has {len(found)} figures and the record {len(values)}: "
                "a figure added to or taken from the prose goes into the record's list too "
                f"(the passage's: {[f.group(0) for f in found]})"
            )
        out, pos = [], 0
        for f, value in zip(found, values):
            out += [body[pos : f.start()], value]
            pos = f.end()
        return m.group(1) + "".join(out) + body[pos:] + m.group(5)

    def one(m: re.Match[str]) -> str:
        at = f"{where}, figure:{m.group('ref')}.{m.group('key')}"
        value = _value(record_for(m.group("ref"), directory, newest, at), m.group("key"), at, str)
        return m.group(1) + value + m.group(5)

    return _ONE.sub(one, _PASSAGE.sub(passage, text))
