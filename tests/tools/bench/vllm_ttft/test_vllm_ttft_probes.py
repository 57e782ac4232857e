"""The process probes of `bench vllm`: what it reads to know the other engine has gone idle."""

from __future__ import annotations

import subprocess
import sys
import time

from kv_offload_tools.bench.vllm_ttft.probes import cpu_seconds, tree_cpu_seconds

# A parent that starts a child spinning on the CPU, then sleeps (as vLLM's driver starts its
# engine core, whose polling is what the bench waits out).
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _grows_by(root: int, seconds: float) -> float:
    before = tree_cpu_seconds(root)
    time.sleep(seconds)
    return tree_cpu_seconds(root) - before


def test_a_process_trees_cpu_counts_a_spinning_child_and_stops_when_it_stops() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        # The child spins: the tree's CPU grows although the parent itself sleeps.
        deadline = time.monotonic() + 60
        while cpu_seconds(child) is None or cpu_seconds(child) < 0.05:
            assert time.monotonic() < deadline, "the spinning child never ran"
            time.sleep(0.05)
        assert _grows_by(parent.pid, 0.5) > 0.05
        assert (cpu_seconds(parent.pid) or 0.0) < tree_cpu_seconds(parent.pid)
        # Once the child is stopped, the tree is idle again.
        subprocess.run(["kill", "-STOP", str(child)], check=True)
        assert _grows_by(parent.pid, 0.5) <= 0.02
    finally:
        if child is not None:
            subprocess.run(["kill", "-KILL", str(child)], check=False)
        parent.kill()
        parent.wait()


def test_a_process_that_is_gone_counts_nothing() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert tree_cpu_seconds(gone.pid) == 0.0
