"""How `bench vllm` pins engines it started on every core: each thread still on the cores it
started on moves to the compute cores, and a thread that chose its own cores keeps them (the
CPU harness's copy threads run off the compute cores, as they would in an engine started
pinned)."""

from __future__ import annotations

import os
import subprocess
import sys

from kv_offload_tools.bench.vllm_ttft.probes import thread_cores
from kv_offload_tools.bench.vllm_ttft.run import pin_tree

# A parent with a thread that moves itself to core argv[1] (as a copy thread does), a thread
# that stays where it started, and a child process; it says "ready" once all are in place.
_ENGINE_LIKE = """
import os, subprocess, sys, threading
moved, hold = threading.Event(), threading.Event()
def own_core():
    os.sched_setaffinity(0, {int(sys.argv[1])})
    moved.set()
    hold.wait()
threading.Thread(target=own_core, daemon=True).start()
threading.Thread(target=hold.wait, daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
moved.wait()
print("ready", child.pid, flush=True)
sys.stdin.read()
child.kill()
"""


def test_threads_still_on_their_starting_cores_move_and_a_thread_on_its_own_core_stays() -> None:
    started_on = os.sched_getaffinity(0)
    compute, other = sorted(started_on)[:2]  # a host with one core fails here: the rule needs two
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE_LIKE, str(other)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        word, child = engine.stdout.readline().split()
        assert word == "ready"
        everywhere = ",".join(map(str, sorted(started_on)))
        before = thread_cores(engine.pid)
        assert before == {everywhere: 3, str(other): 1}  # the parent's main and idle thread, the child

        pin_tree(engine.pid, {compute}, started_on)

        after = thread_cores(engine.pid)
        assert after == {str(compute): 3, str(other): 1}
        assert os.sched_getaffinity(int(child)) == {compute}  # the child process moved too
    finally:
        engine.stdin.close()
        engine.wait(timeout=30)
