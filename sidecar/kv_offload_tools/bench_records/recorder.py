"""``kv-offload bench NAME ... --record DIR``: the run stored as a dated record in DIR.

The CLI's dispatcher adds ``--record`` to every bench (``add_record_flag``) and, when it
is given, runs the bench through ``recorded``: a bench with a ``--json`` flag is asked for
JSON (as if ``--json`` had been given; ``--json PATH`` is read back from PATH), its stdout
is still printed and also kept (a ``--json PATH`` flag not given is pointed at a scratch
file, read back and removed), and the record (``bench_records.write``) gets the date, the
commit, the host's facts, the command line, the report (or the text printed when it was
not JSON), its tables and named figures (``shape.convert``) and the exit code. Nothing else
of a bench changes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kv_offload_tools import bench_records as records
from kv_offload_tools.bench_records.shape import convert


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    """``--record DIR`` on a bench's parser, remembering how its ``--json`` asks for JSON."""
    json_flag = next((a for a in parser._actions if a.dest == "json"), None)  # noqa: SLF001
    parser.set_defaults(_record_json=(json_flag.default, json_flag.const) if json_flag else None)
    parser.add_argument("--record", metavar="DIR", default="",
                        help="also store this run as DIR/<bench>/<date>.json and its page "
                             "(e.g. docs/benchmarks; then python -m kv_offload_tools.bench_records --write)")


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, out: Any) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def _parse_report(printed: str, json_path: str) -> dict[str, Any] | None:
    if json_path and os.path.isfile(json_path):
        with open(json_path) as fh:
            return json.load(fh)
    text = printed.strip()
    start = text.find("{")
    if start < 0:
        return None
    try:
        report = json.loads(text[start:])
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


def recorded(args: argparse.Namespace, argv: Sequence[str], run: Callable[[argparse.Namespace], Any]) -> int:
    """Run the bench, then write its record into ``args.record``; the bench's exit code."""
    json_flag, json_path, scratch = getattr(args, "_record_json", None), "", ""
    if json_flag is not None:
        default, const = json_flag
        if args.json == default and const is None:  # --json PATH not given: a file of our own
            fd, scratch = tempfile.mkstemp(prefix=f"kv-offload-bench-{args.bench}-", suffix=".json")
            os.close(fd)
            args.json = json_path = scratch
        elif args.json == default:
            args.json = const
        elif isinstance(args.json, str) and args.json != const:
            json_path = args.json  # --json PATH: the report is in that file
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        code = int(run(args) or 0)
    printed = tee.kept.getvalue()
    report = _parse_report(printed, json_path)
    if scratch:
        os.unlink(scratch)
    notes: dict[str, str] = {}
    try:
        shown = convert(args.bench, report)
    except KeyError as exc:  # a renamed report key costs the tables, never the run
        shown, notes["record"] = {"tables": [], "figures": {}}, f"no tables: {exc.args[0]}"
        print(f"[bench {args.bench}] {notes['record']}", file=sys.stderr)
    record: dict[str, Any] = {
        "bench": args.bench, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": records.git_commit(), "host": records.host_facts(),
        "command": "kv-offload " + shlex.join(argv), "imported": "", "exit_code": code,
        "tables": shown["tables"], "figures": shown["figures"], "notes": notes,
    }
    if report is not None:
        record["report"] = report
    else:
        record["output"] = printed
    path = records.write(Path(args.record), record)
    print(f"[bench {args.bench}] recorded {path} and {path.with_suffix('.md').name}; "
          "python -m kv_offload_tools.bench_records --write renders the docs from it", file=sys.stderr)
    return code
