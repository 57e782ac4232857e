"""Progress lines of the tools' commands: on stderr and flushed at once, so stdout holds only the report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def to_stderr(line: str) -> None:
    """Print ``line`` on stderr now (a command's live progress)."""
    print(line, file=sys.stderr, flush=True)


def timestamped(command: str, quiet: bool = False) -> Callable[[str], None]:
    """Progress that prints ``[command HH:MM:SS] line`` on stderr, or nothing when ``quiet``."""
    if quiet:
        return lambda line: None
    return lambda line: to_stderr(f"[{command} {time.strftime('%H:%M:%S')}] {line}")


def rows_to(json_out: bool) -> Callable[[str], None]:
    """Where a command prints its rows: stdout, or stderr when stdout carries its JSON (``--json``)."""
    return to_stderr if json_out else print
