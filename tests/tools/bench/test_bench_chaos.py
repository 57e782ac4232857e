"""`kv-offload bench chaos`: bad input is one line and exit 2, before any sidecar starts.

The fault and fuzz runs themselves are tested under tests/tools/chaos.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [os.path.join(os.path.dirname(sys.executable), "kv-offload"), "bench", "chaos"]


@pytest.mark.parametrize(("args", "named"), [
    (["--kills", "0"], "--kills 0 must be at least 1"),
    (["--fuzz", "--fuzz-cases", "5"], "--fuzz-cases 5 must be at least 6"),
    (["--seconds", "0"], "--seconds 0.0 must be positive"),
    (["--chunk-bytes", "5000"], "--chunk-bytes 5000 must be a positive multiple of 4096"),
], ids=["kills", "fuzz-cases", "seconds", "chunk-bytes"])
def test_bad_input_is_one_line_and_exit_2(args: list[str], named: str) -> None:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [named]
