"""A process frozen by SIGSTOP, waited for until every thread of it has stopped.

kill(2) returns before the stop takes effect: a thread of the target that is running may
run on for a moment, and a request sent right after can still be answered (a holder answers
LOOKUPs and heartbeats on a thread of the connection, without its event loop). Whoever means
"this process answers nothing from now on" (a test, a chaos fault) freezes it with ``freeze``
and resumes it with SIGCONT as before.
"""

from __future__ import annotations

import os
import signal
import time

# /proc/<pid>/task/<tid>/stat states of a thread that runs no code: stopped, traced, dead.
_STILL = frozenset("tTZX")
# Seconds before a freeze gives up: a safety net far above what any stop takes.
FREEZE_TIMEOUT_SECONDS = 30.0


def freeze(pid: int, timeout: float = FREEZE_TIMEOUT_SECONDS) -> None:
    """SIGSTOP ``pid`` and return once each of its threads has stopped; TimeoutError naming the
    process when some thread still runs after ``timeout`` seconds."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _threads_still(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still had a running thread {timeout:g} s after SIGSTOP")
        time.sleep(0.002)


def _threads_still(pid: int) -> bool:
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] not in _STILL:  # the state follows "(comm) "
            return False
    return True
