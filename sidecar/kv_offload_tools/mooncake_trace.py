"""Mooncake-format request traces and the sample shipped in ``data/`` (demo and replay bench).

Each line is one request: ``hash_ids`` name its prompt blocks in prefix order
(equal ids at equal positions mean equal prefixes).
"""

from __future__ import annotations

import json
from pathlib import Path

# The sample of a Mooncake trace shipped with the tools (see data/NOTICE-mooncake-trace.md).
TRACE_SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_trace_sample.jsonl"


def load_trace(path: str | Path) -> list[list[int]]:
    """The hash_ids of every request (requests without ids skipped).

    ValueError naming the file, and the line and field when a line is not a
    trace line; also when the file cannot be read or holds no request.
    """
    out = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read trace {str(path)!r}: {exc.strerror}; pass --trace FILE") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
                    raise TypeError("hash_ids must be a list of integers")
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line (timestamp, input_length, "
                                 f"output_length, hash_ids): {exc}") from None
            if ids:
                out.append(ids)
    if not out:
        raise ValueError(f"trace {str(path)!r} has no requests")
    return out
