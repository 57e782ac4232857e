"""What a stranger's input may cost in logs, and how any untrusted JSON is parsed.

``RejectionLog`` summarises rejections: the first of a (source, reason) pair in
an interval is logged at once, later ones are only counted and written as one
line per pair when the interval ends (``... and N more in 60 s``); the number
of pairs remembered is bounded, so a flood from many sources costs a bounded
number of lines. Every event still goes to the ``kv_offload_*`` counters,
which the caller increments itself.

``loads_bounded`` parses untrusted JSON with a bounded nesting depth and
number size: anything else is a ``ValueError`` naming what is wrong, never a
``RecursionError`` or a 4,300-digit integer conversion.

``clip`` shortens a value for a log line.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

# Longest value written into a log line (characters).
CLIP_CHARS = 120
# Deepest nesting of arrays/objects accepted in untrusted JSON.
MAX_JSON_DEPTH = 32
# Longest integer or float literal accepted in untrusted JSON (characters).
MAX_NUMBER_CHARS = 40


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """``repr``-free text of ``value`` cut to ``limit`` characters (with the length cut)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _number(text: str) -> int | float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return float(text) if any(c in text for c in ".eE") else int(text)


def _depth_ok(text: str, limit: int) -> bool:
    """True when no array/object nests deeper than ``limit`` (strings are skipped)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def loads_bounded(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON value of ``data``; ValueError for bad UTF-8, bad JSON, deep nesting or huge numbers."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 at byte {exc.start}") from None
    if text.count("[") + text.count("{") > max_depth and not _depth_ok(text, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_int=_number, parse_float=_number,
                          parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:  # belt and braces: the pre-scan bounds the depth
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


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

    def reject(self, source: str, reason: str, detail: Any = "") -> None:
        """Note one rejection; logs at most one line per pair per interval (plus summaries)."""
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
                suffix = f": {clip(detail)}" if detail != "" else ""
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


__all__ = ["CLIP_CHARS", "MAX_JSON_DEPTH", "MAX_NUMBER_CHARS", "RejectionLog", "clip",
           "loads_bounded"]
