"""Processes holding many open descriptors, as a sidecar of a large pool or vLLM's own process do.

``select.select`` fails for a descriptor of 1,024 or more; these helpers make every socket a
process opens next land above that: ``holding(n)`` opens ``n`` descriptors in this process
(raising the soft ``RLIMIT_NOFILE`` as needed) for a ``with`` block, and ``launcher(n)`` is a
``LocalPool`` launcher whose sidecars start with ``n`` inherited descriptors held open.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

from kv_offload_testing.local_pool import sidecar_command

# Descriptors a process of the tests holds: past FD_SETSIZE (1,024), as in the trial.
PAST_FD_SETSIZE = 1100


def raise_nofile(needed: int) -> None:
    """Raise this process's soft descriptor limit to at least ``needed`` (up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


@contextlib.contextmanager
def holding(n: int = PAST_FD_SETSIZE) -> Iterator[list[int]]:
    """``n`` descriptors of /dev/null held open in this process for the block."""
    raise_nofile(n + 256)
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


# Run by the launched process: hold N inherited descriptors, then become the sidecar.
_HOLD_THEN_EXEC = """
import os, resource, sys
n = int(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, n + 1024), hard), hard))
for _ in range(n):
    os.set_inheritable(os.open(os.devnull, os.O_RDONLY), True)
os.execv(sys.argv[2], sys.argv[2:])
"""


def launcher(n: int = PAST_FD_SETSIZE) -> Callable[[Sequence[str], Mapping[str, str]], list[str]]:
    """A ``LocalPool`` launcher: each sidecar starts holding ``n`` open descriptors."""
    def argv(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return [sys.executable, "-c", _HOLD_THEN_EXEC, str(n), *sidecar_command(), *args]
    return argv


def open_descriptors(pid: int) -> int:
    """Descriptors process ``pid`` holds now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


__all__ = ["PAST_FD_SETSIZE", "holding", "launcher", "open_descriptors", "raise_nofile"]
