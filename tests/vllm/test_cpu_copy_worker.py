"""The CPU harness's copy worker (``kv_offload_tools.vllm_harness.cpu_spec``) copies off
the engine's step, as a GPU copies by DMA: a job runs after its submit returns, on a thread
outside the engine thread's cores, and is reported only once its copy has ended.

Runs in ``.venv-vllm``'s Python (the module imports vLLM); needs ``./dev setup``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

# Drives _CopyJobs/_CopyStream with a handler whose copy waits for the test's go, so each
# state (submitted, copying, finished) is observed, not timed. Prints one JSON line.
_DRIVER = r"""
import json, os, threading
def placeable():
    # The cores a thread of this process may be moved to, each tried on a throwaway thread.
    ok = []
    def probe():
        for core in range(os.cpu_count() or 1):
            try:
                os.sched_setaffinity(0, {core})
                ok.append(core)
            except OSError:
                pass
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return ok

allowed = placeable()
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # the engine thread, on one core
import numpy as np
from kv_offload_tools.vllm_harness.cpu_spec import _CopyJobs, _CopyStream, _copy_cores, merge_adjacent
merged = merge_adjacent(np.array([100, 110, 200, 300, 310, 320]), np.array([0, 10, 20, 50, 60, 90]),
                        np.array([10, 10, 10, 10, 5, 5]))

class Handler:
    def __init__(self):
        self.started, self.go, self.cores = threading.Event(), threading.Event(), None
    def transfer(self, src, dst):
        self.cores = sorted(os.sched_getaffinity(0))
        self.started.set()
        self.go.wait()
        if src == "bad":
            raise ValueError("a copy that fails")
        return 4096

jobs, handler = _CopyJobs(), Handler()
stream = _CopyStream("test-copy", handler, _copy_cores(), jobs)
stream.submit(7, "src", "dst")
handler.started.wait()
before = [r.job_id for r in jobs.take_finished()]  # copying: nothing reported yet
handler.go.set()
jobs.wait({7})
after = [(r.job_id, r.success, r.transfer_size) for r in jobs.take_finished()]
stream.submit(8, "bad", "dst")
jobs.wait({8})
failed = [(r.job_id, r.success) for r in jobs.take_finished()]
stream.close()
print(json.dumps({"merged": merged, "before": before, "after": after, "failed": failed,
                  "copy_cores": handler.cores, "engine_cores": sorted(os.sched_getaffinity(0)),
                  "allowed": allowed}))
"""


@pytest.fixture(scope="module")
def driven() -> dict:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM is not set up: expected {VLLM_PYTHON}. Run ./dev setup.")
    env = {**os.environ, "PYTHONPATH": str(REPO / "sidecar")}
    done = subprocess.run([str(VLLM_PYTHON), "-c", _DRIVER], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_copy_job_is_reported_only_once_its_copy_has_ended(driven: dict) -> None:
    assert driven["before"] == []
    assert driven["after"] == [[7, True, 4096]]


def test_a_copy_that_fails_is_reported_failed_and_the_stream_keeps_serving(driven: dict) -> None:
    assert driven["failed"] == [[8, False]]


def test_copies_run_off_the_engine_threads_cores_where_another_is_allowed(driven: dict) -> None:
    engine = driven["engine_cores"]
    others = sorted(set(driven["allowed"]) - set(engine))
    assert len(engine) == 1
    if others:
        assert driven["copy_cores"] and not set(driven["copy_cores"]) & set(engine)
        assert set(driven["copy_cores"]) <= set(others)
    else:  # a one-core machine: the copies share the engine's core
        assert driven["copy_cores"] == engine


def test_copies_that_continue_both_source_and_destination_are_one_memmove(driven: dict) -> None:
    # 100+10 continues 110 (and 0+10 continues 10); 110+10 is not 200; 310+5 is not 320.
    assert driven["merged"] == [[100, 200, 300, 320], [0, 20, 50, 90], [20, 10, 15, 5]]
