"""A command refusing its input: exit 2, nothing on stdout, one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping

import pytest


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


def refuses_each(cli: list[str], cases: Mapping[str, tuple[list[str], str]]) -> Callable[..., None]:
    """A test, parametrized by ``cases`` (id -> (args, the line it must say)), that ``cli args``
    is refused with exactly that line; a test module binds it to its test's name."""
    @pytest.mark.parametrize(("args", "named"), list(cases.values()), ids=list(cases))
    def test(args: list[str], named: str) -> None:
        assert refusal(cli, *args) == named
    return test
