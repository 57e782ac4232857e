"""Untrusted JSON with a bounded nesting depth and number size (standard library only).

``loads_bounded`` is the one parser of JSON from outside this process: the
local channel's frames (both sides) and the sidecar's HTTP bodies. Anything
else than plain JSON within the bounds is a ``ValueError`` naming what is
wrong, never a ``RecursionError`` or a 4,300-digit integer conversion.
"""

from __future__ import annotations

import json
from typing import Any

# Deepest nesting of arrays/objects accepted in untrusted JSON.
MAX_JSON_DEPTH = 32
# Longest integer or float literal accepted in untrusted JSON (characters).
MAX_NUMBER_CHARS = 40


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


__all__ = ["MAX_JSON_DEPTH", "MAX_NUMBER_CHARS", "loads_bounded"]
