"""A bench's numeric flags as a table of ``(flag, default, lowest, help)``: their arguments (typed
as the default is) and the check that refuses a value under its lowest, naming flag and bound."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from kv_offload_sidecar.usage import UsageError

NumberFlag = tuple[str, float, float, str]


def add_number_flags(parser: argparse.ArgumentParser, flags: Iterable[NumberFlag]) -> None:
    for flag, default, low, text in flags:
        parser.add_argument(flag, type=type(default), default=default,
                            help=f"{text}; at least {low:g} (default {default:g})")


def check_number_flags(args: argparse.Namespace, flags: Iterable[NumberFlag]) -> None:
    """Raise UsageError for the first flag under its lowest (NaN included)."""
    for flag, _default, low, _text in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value >= low:
            raise UsageError(f"{flag} {value:g} must be at least {low:g}")
