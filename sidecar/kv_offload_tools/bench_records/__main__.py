"""``python -m kv_offload_tools.bench_records [--write | --check] [--records DIR]``: render
every page, the benchmarks index and the README's results from the bench records.

``--check`` (the default) prints each file that differs from what its records render and
exits 1 if any does; ``--write`` rewrites them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kv_offload_tools import bench_records as records
from kv_offload_tools.bench_records.render import expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_offload_tools.bench_records", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite every rendered file")
    mode.add_argument("--check", action="store_true", help="exit 1 naming the files that differ (default)")
    parser.add_argument("--records", type=Path, default=records.RECORDS_DIR,
                        help="the records' directory (default %(default)s)")
    args = parser.parse_args(argv)
    rendered = expected(args.records)
    stale = [path for path, text in rendered.items() if not path.exists() or path.read_text() != text]
    for path in stale:
        if args.write:
            path.write_text(rendered[path])
        print(f"{'rewrote' if args.write else 'differs from its records'}: {path}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
