"""`kv-offload bench restarts`: bad input is one line and exit 2; a short run prints every
round and the totals against the target, and exits 0 when they meet it."""

from __future__ import annotations

import json
import subprocess

from kv_offload_tools.shm_restarts import tmpfs_unavailable
from refusal import bench, refuses_each
from host_rights import require

CLI = bench("restarts")


test_bad_input_is_one_line_and_exit_2 = refuses_each(CLI, {
    "rounds": (["--rounds", "0"], "--rounds 0 must be at least 1"),
    "capacity": (["--capacity-mib", "0"], "--capacity-mib 0 must be at least 1"),
    "target-nan": (["--hit-within-seconds", "nan"], "--hit-within-seconds nan must be at least 0.1"),
})


def test_two_sigkills_on_a_bounded_shm_come_back_with_no_engine_error() -> None:
    require(tmpfs_unavailable())
    # How fast is the bench's to say, not the suite's: the target here only keeps the exit 0.
    done = subprocess.run([*CLI, "--rounds", "2", "--capacity-mib", "8", "--hit-within-seconds",
                           "1000", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert len(figures["rounds"]) == 2 and figures["reattaches"] == 2
    s = figures["summary"]
    assert s["served"] == s["hit_again"] == s["within"] == 2 and s["met"] is True
    assert s["engine_errors"] == 0 and s["corrupt"] == 0
    assert "round   2: serving after" in done.stderr  # the rows go to stderr with --json
