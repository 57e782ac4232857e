"""Bench records: every figure the docs quote comes from a dated JSON file.

A record is one bench run, stored as ``docs/benchmarks/<bench>/<YYYY-MM-DD>.json``
(``-2``, ``-3`` ... for later runs the same day) beside the page rendered from it
(same name, ``.md``). Its keys:

- ``bench``: the bench's name (``transport``, ``gpu``, ...).
- ``date``: the day it was measured, ``YYYY-MM-DD`` (UTC).
- ``commit``: the git commit of the code that ran, ``""`` when unknown.
- ``host``: facts about the machine (``cores``, ``usable_cores``, ``cpu_model``,
  ``memory_gib``, ``platform``, ``python``, ``gpu``), or for an imported record what
  the page said of it (``description``).
- ``command``: the command line that produced it.
- ``imported``: ``""`` for a recorded run; for figures typed into the docs before
  records existed, where they were taken from (``docs/benchmarks.md at <commit>``).
- ``tables``: the figures, each ``{"title", "columns", "align", "rows"}`` (cells are
  strings, as the page prints them; ``imported``: where a table added to an imported record
  was typed, ``<page> at <commit> (<date>)``).
- ``notes``: free text keyed by where it is shown (``readme``: appended to the
  README's row).
- ``figures``: figures quoted in prose, by key: a string (a ``figure:`` marker's text) or a
  list of strings (a ``figures:`` passage's numbers in order); ``prose.py``.
- ``figures_imported``: for a figure typed into a page before a record held it, where it
  was typed (``README.md at <commit> (<date>)``, from ``git blame``).
- ``report``: what the bench printed as JSON (absent for imported records), or
  ``output``: what it printed as text.

``kv-offload bench NAME ... --record DIR`` writes one (``recorder.py``), its tables and named
figures converted from the report as the bench's ``record.py`` names them (``shape.py``);
``python -m kv_offload_tools.bench_records --write`` re-renders the pages, the
index, the README's results and every figure marker in the docs from the records
(``render.py``, ``readme.py``, ``prose.py``), and
``--check`` exits 1 naming every file that differs from what its records render.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

# The repository this package sits in (sidecar/kv_offload_tools/bench_records -> root).
REPO = Path(__file__).resolve().parents[3]
# Where records live, relative to the repository.
RECORDS_DIR = REPO / "docs" / "benchmarks"
# A record's file name: the day, then -N for the N-th run that day.
_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})(?:-(\d+))?\.json$")


def host_facts() -> dict[str, Any]:
    """What the machine running a bench is: cores, CPU model, memory, platform, GPU."""
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    memory = 0.0
    try:
        with open("/proc/meminfo") as fh:
            kib = next((int(ln.split()[1]) for ln in fh if ln.startswith("MemTotal:")), 0)
        memory = round(kib / (1 << 20), 1)
    except (OSError, ValueError):
        pass
    gpu = ""
    if shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().replace("\n", ", ")
        except (OSError, subprocess.SubprocessError):
            gpu = ""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return {"cores": os.cpu_count() or 0, "usable_cores": usable, "cpu_model": model or platform.processor(),
            "memory_gib": memory, "platform": platform.platform(), "python": platform.python_version(),
            "gpu": gpu}


def git_commit(repo: Path = REPO) -> str:
    """The commit checked out in ``repo``, ``+dirty`` when files differ from it; ``""`` outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


def record_paths(directory: Path, bench: str) -> list[Path]:
    """The bench's records in ``directory``, oldest first."""
    folder = Path(directory) / bench
    found = [(m.group(1), int(m.group(2) or 1), p) for p in folder.glob("*.json") if (m := _NAME.match(p.name))]
    return [p for _, _, p in sorted(found)]


def load(path: Path) -> dict[str, Any]:
    """One record."""
    with open(path) as fh:
        return json.load(fh)


def benches(directory: Path = RECORDS_DIR) -> list[str]:
    """The benches with at least one record in ``directory``."""
    root = Path(directory)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and record_paths(root, p.name)) \
        if root.is_dir() else []


def latest(directory: Path = RECORDS_DIR) -> dict[str, dict[str, Any]]:
    """bench -> its newest record in ``directory`` (with ``path``: the file, relative to ``directory``)."""
    out = {}
    for bench in benches(directory):
        path = record_paths(directory, bench)[-1]
        out[bench] = {**load(path), "path": f"{bench}/{path.name}"}
    return out


def next_path(directory: Path, bench: str, date: str) -> Path:
    """Where a new record of ``bench`` measured on ``date`` goes: the day's first free name."""
    folder = Path(directory) / bench
    path, n = folder / f"{date}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{date}-{n}.json"
    return path


def write(directory: Path, record: dict[str, Any]) -> Path:
    """Store ``record`` as its dated JSON and the page rendered from it; the JSON's path."""
    from kv_offload_tools.bench_records.render import record_page

    path = next_path(directory, record["bench"], record["date"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    path.with_suffix(".md").write_text(record_page(record))
    return path
