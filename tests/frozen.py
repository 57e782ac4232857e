"""A process frozen by SIGSTOP, waited for until every thread of it has stopped.

kill(2) returns before the stop takes effect: a thread of the target that is running may
run on for a moment, and a request sent right after can still be answered (a holder answers
LOOKUPs and heartbeats on a thread of the connection, without its event loop). A test that
means "this process answers nothing from now on" freezes it with ``freeze`` and resumes it
with SIGCONT as before.
"""

from __future__ import annotations

import os
import signal

from waiting import wait_for

# /proc/<pid>/task/<tid>/stat states of a thread that runs no code: stopped, traced, dead.
_STILL = frozenset("tTZX")


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once each of its threads has stopped."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(f"every thread of process {pid} stopped", lambda: _threads_still(pid), interval=0.002)


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
