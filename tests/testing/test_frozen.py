"""``kv_offload_testing.frozen``: a process is frozen only once every thread of it has stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kv_offload_testing.frozen import freeze

# Two threads spinning: the main one and another, so the stop has more than one to reach.
_SPINNER = "import threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n" \
           "print('spinning', flush=True)\nwhile True: pass\n"


def _states(pid: int) -> list[str]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        out.append(stat[stat.rindex(")") + 2])
    return out


def test_freeze_returns_once_every_thread_is_stopped_and_sigcont_resumes_them() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"spinning\n"
        freeze(proc.pid)
        states = _states(proc.pid)
        assert len(states) >= 2 and set(states) <= set("tT"), states
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)
