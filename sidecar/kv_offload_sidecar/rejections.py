"""What a stranger's input may cost in logs, and how any untrusted JSON is parsed.

``RejectionLog`` summarises rejections: the first of a (source, reason) pair in
an interval is logged at once, later ones are only counted and written as one
line per pair when the interval ends (``... and N more in 60 s``); the number
of pairs remembered is bounded, so a flood from many sources costs a bounded
number of lines. Every event still goes to the ``kv_offload_*`` counters,
which the caller increments itself.

``loads_bounded`` parses untrusted JSON with a bounded nesting depth (numbers
bounded by the interpreter): anything else is a ``ValueError`` naming what is
wrong, never a ``RecursionError`` (``engine/bounded_json.py``).

``clip`` shortens a value for a log line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

# Untrusted JSON is parsed by the one bounded parser both sides of the local channel use.
from kv_offload_sidecar.engine.bounded_json import MAX_JSON_DEPTH, loads_bounded

# Longest value written into a log line (characters).
CLIP_CHARS = 120


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """``repr``-free text of ``value`` cut to ``limit`` characters (with the length cut)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class RejectionLog:
    """Rate-limited WARNING lines for rejected input: one per (source, reason) per interval."""

    def __init__(self, logger: logging.Logger, *, interval: float = 60.0,
                 max_pairs: int = 256, clock: Any = time.monotonic) -> None:
        self._log = logger
        self._interval = interval
        self._max_pairs = max_pairs
        self._clock = clock
        self._lock = threading.Lock()
        # (source, reason) -> [window start, events suppressed since]
        self._pairs: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        # Events whose pair could not be remembered (too many pairs), since the last line.
        self._overflow = 0
        self._overflow_since = 0.0
        # Lines written so far (tests and benches read it).
        self.lines = 0

    def reject(self, source: str, reason: str, detail: Any = "", *, detail_chars: int = CLIP_CHARS) -> None:
        """Note one rejection; logs at most one line per pair per interval (plus summaries).

        ``detail`` is clipped to ``detail_chars`` (longer only for what a caller proved it may
        say, e.g. a key holder's field diff).
        """
        now = self._clock()
        source, reason = clip(source, 64), clip(reason, 64)
        out: list[str] = []
        with self._lock:
            self._flush_expired(now, out)
            pair = (source, reason)
            entry = self._pairs.get(pair)
            if entry is not None:
                entry[1] += 1
            elif len(self._pairs) >= self._max_pairs:
                if not self._overflow:
                    self._overflow_since = now
                self._overflow += 1
                if now - self._overflow_since >= self._interval:
                    out.append(f"rejected {self._overflow} more requests from "
                               f"{self._max_pairs}+ sources in {self._interval:.0f} s")
                    self._overflow = 0
            else:
                self._pairs[pair] = [now, 0]
                suffix = f": {clip(detail, detail_chars)}" if detail != "" else ""
                out.append(f"rejected {source}: {reason}{suffix}")
            self.lines += len(out)
        for line in out:
            self._log.warning("%s", line)

    def flush(self) -> None:
        """Write the summaries of every window that has ended (also done on each ``reject``)."""
        out: list[str] = []
        with self._lock:
            self._flush_expired(self._clock(), out)
            self.lines += len(out)
        for line in out:
            self._log.warning("%s", line)

    def _flush_expired(self, now: float, out: list[str]) -> None:
        expired = [p for p, (start, _) in self._pairs.items() if now - start >= self._interval]
        for pair in expired:
            _, more = self._pairs.pop(pair)
            if more:
                out.append(f"rejected {pair[0]}: {pair[1]} and {more} more in "
                           f"{self._interval:.0f} s")


__all__ = ["CLIP_CHARS", "MAX_JSON_DEPTH", "RejectionLog", "clip", "loads_bounded"]
