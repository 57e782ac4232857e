"""The ``ip`` and ``tc`` commands, and entering a network namespace from one thread.

``run`` raises ``NetnsError`` with the command and its stderr on a non-zero exit.
``unavailable()`` says why network namespaces cannot be made here (None when they
can): the tests skip with that sentence. ``inside(netns)`` moves the calling thread
(only it: a network namespace is per thread in Linux) into a named namespace
(``/run/netns/NAME``) for the block and back after it; sockets made inside stay in
that namespace, so an engine client or a probe made there talks pod to pod through
the router. Paths in the file system (Unix sockets, shared memory) are not
affected: they are the same in every network namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence

# setns(2) flag of a network namespace.
CLONE_NEWNET = 0x40000000
# Where `ip netns add` pins its namespaces.
NETNS_DIR = "/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed."""


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    """Run a command; its stdout. NetnsError naming the command and its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from None
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """``ip [-n NETNS] ARGS``."""
    return run(["ip", *(("-n", netns) if netns else ()), *args], check=check)


def tc(*args: str, netns: str | None = None, check: bool = True) -> str:
    """``tc [-n NETNS] ARGS``."""
    return run(["tc", *(("-n", netns) if netns else ()), *args], check=check)


def in_netns(netns: str, argv: Sequence[str], *, check: bool = True) -> str:
    """Run ``argv`` inside ``netns`` (``ip netns exec``: the namespace's hosts file applies)."""
    return run(["ip", "netns", "exec", netns, *argv], check=check)


def unavailable() -> str | None:
    """Why this process cannot make network namespaces (one sentence), or None when it can."""
    if not shutil.which("ip") or not shutil.which("tc"):
        return "network namespaces are not usable here (no ip or tc command): install iproute2"
    name = f"kvn-{os.getpid()}-check"
    try:
        ip("netns", "add", name)
    except NetnsError as exc:
        return f"network namespaces are not permitted here (ip netns add: {exc}): run as root on Linux"
    try:
        with inside(name):
            pass
    except OSError as exc:
        return f"network namespaces are not permitted here (setns: {exc}): run as root on Linux"
    finally:
        ip("netns", "del", name, check=False)
    return None


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """This thread in network namespace ``netns`` for the block, then back where it was."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)

