"""Untrusted JSON with a bounded nesting depth (standard library only).

``loads_bounded`` is the one parser of JSON from outside this process: the
local channel's frames (both sides) and the sidecar's HTTP bodies. Anything
else than plain JSON within the bounds is a ``ValueError`` naming what is
wrong, never a ``RecursionError``. Numbers are the interpreter's to bound:
CPython (3.11+) refuses an integer literal over ``sys.get_int_max_str_digits()``
digits (4,300 unless ``PYTHONINTMAXSTRDIGITS`` says otherwise) with a
``ValueError`` before any quadratic conversion, and parses floats in linear time;
a per-number hook cost ten times the parse (a frame of 65,536 row indices: 52 ms
against json.loads' 5 ms). NaN and Infinity are refused (``parse_constant``): they are not JSON.
"""

from __future__ import annotations

import json
from typing import Any

# Deepest nesting of arrays/objects accepted in untrusted JSON.
MAX_JSON_DEPTH = 32


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
    """JSON value of ``data``; ValueError for bad UTF-8, bad JSON, deep nesting, NaN/Infinity or
    an integer over the interpreter's digit limit."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 at byte {exc.start}") from None
    if text.count("[") + text.count("{") > max_depth and not _depth_ok(text, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:  # belt and braces: the pre-scan bounds the depth
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


__all__ = ["MAX_JSON_DEPTH", "loads_bounded"]
