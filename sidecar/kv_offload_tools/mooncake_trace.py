"""Mooncake-format request traces and the sample shipped in ``data/`` (demo and replay bench).

Each line is one request: ``hash_ids`` name its prompt blocks in prefix order
(one id per 512-token block; equal ids at equal positions mean equal
prefixes), with its ``timestamp`` (ms) and, in generated conversation traces
(``workloads``), the ``session_id`` a session-affine router keys on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The sample of a Mooncake trace shipped with the tools (see data/NOTICE-mooncake-trace.md).
TRACE_SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_trace_sample.jsonl"
# Tokens of one block (Mooncake's block size; the replay's chunk).
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request of a replayed or generated stream."""

    # Arrival time in milliseconds from the start of the stream.
    timestamp_ms: int
    # Prompt blocks in prefix order (Mooncake hash_ids).
    hash_ids: tuple[int, ...]
    # Answer length in blocks (what the next turn of a conversation carries on).
    output_blocks: int = 1
    # Conversation the request belongs to; None for traces without sessions.
    session: int | None = None

    def to_json(self) -> str:
        """The request as a Mooncake trace line (plus ``session_id`` when it has one)."""
        rec = {"timestamp": self.timestamp_ms, "input_length": len(self.hash_ids) * BLOCK_TOKENS,
               "output_length": self.output_blocks * BLOCK_TOKENS, "hash_ids": list(self.hash_ids)}
        if self.session is not None:
            rec["session_id"] = self.session
        return json.dumps(rec)


def load_requests(path: str | Path) -> list[TraceRequest]:
    """A Mooncake-format trace file (``session_id`` read when present).

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
                session = rec.get("session_id")
                if session is not None and (isinstance(session, bool) or not isinstance(session, int)):
                    raise TypeError("session_id must be an integer")
                timestamp = int(rec.get("timestamp", 0))
                output = max(1, int(rec.get("output_length", BLOCK_TOKENS)) // BLOCK_TOKENS)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line (timestamp, input_length, "
                                 f"output_length, hash_ids): {exc}") from None
            if ids:
                out.append(TraceRequest(timestamp, tuple(ids), output, session))
    if not out:
        raise ValueError(f"trace {str(path)!r} has no requests")
    return out


def write_requests(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as a Mooncake-format trace (``load_requests`` reads it back)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(r.to_json() + "\n")


def load_trace(path: str | Path) -> list[list[int]]:
    """The hash_ids of every request of a trace file (see ``load_requests``)."""
    return [list(r.hash_ids) for r in load_requests(path)]
