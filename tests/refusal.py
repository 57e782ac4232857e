"""A bench command refusing its input: exit 2, nothing on stdout, one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def bench(name: str) -> list[str]:
    """The command line of ``kv-offload bench <name>`` in this environment."""
    return [os.path.join(os.path.dirname(sys.executable), "kv-offload"), "bench", name]


def refusal(cli: list[str], *args: str, env: Mapping[str, str] | None = None) -> str:
    """The one stderr line of ``cli args``, once it has exited 2 with nothing on stdout."""
    done = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]
