"""LocalPool: sidecars join by identity with the peers named; they die with the process that
started them, and no work directory outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from kv_offload_testing.local_pool import LocalPool, make_workdir, sweep_stale_workdirs
from waiting import wait_for

# Runs in a child process: start a pool, report its sidecars, then wait to be killed.
OWNER_SCRIPT = """
import json, sys, time
from kv_offload_testing.local_pool import LocalPool
pool = LocalPool(2).start()
print(json.dumps({"pids": [s.proc.pid for s in pool.sidecars], "workdir": pool.workdir,
                  "stores": [s.status()["store"]["path"] for s in pool.sidecars]}), flush=True)
time.sleep(600)
"""


def pid_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sidecars_exit_and_unlink_their_stores_when_the_pool_owner_is_sigkilled():
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True)
    info = None
    try:
        line = owner.stdout.readline()
        assert line, f"the pool owner exited with {owner.wait(10)} before reporting its pool"
        info = json.loads(line)
        assert all(pid_running(p) for p in info["pids"])
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        # The sidecars notice their parent is gone and shut down gracefully.
        wait_for(f"sidecars {info['pids']} to exit after their parent was killed",
                 lambda: not any(pid_running(p) for p in info["pids"]))
        assert [p for p in info["stores"] if os.path.exists(p)] == []
        # The owner's work directory is named after it; the next pool removes it.
        assert os.path.isdir(info["workdir"])
        pool = LocalPool(1)
        try:
            assert not os.path.exists(info["workdir"])
        finally:
            pool.stop()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        for pid in (info or {}).get("pids", []):
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)


def test_stop_removes_the_pool_work_directory():
    pool = LocalPool(1).start()
    workdir = pool.workdir
    assert os.path.isdir(workdir) and os.path.basename(workdir).startswith(f"kvo-{os.getpid()}-")
    pool.stop()
    assert not os.path.exists(workdir)


def test_sweep_keeps_directories_of_living_owners(tmp_path):
    mine = make_workdir("kvo-", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    theirs = tmp_path / f"kvo-{dead.pid}-abc123"
    theirs.mkdir()
    (theirs / "sidecar-0.log").write_text("left behind")
    unrelated = tmp_path / "kvo-notapid"
    unrelated.mkdir()
    assert sweep_stale_workdirs("kvo-", str(tmp_path)) == [str(theirs)]
    assert os.path.isdir(mine) and os.path.isdir(unrelated) and not theirs.exists()


def test_sidecars_added_by_identity_dial_only_the_peers_named():
    with LocalPool(0) as pool:
        a = pool.add(identity="a", peers=[])
        b = pool.add(identity="b", peers=["a"], capacity_bytes=2 << 20)
        assert pool["a"] is a and pool[1] is b
        assert pool.members() == []  # outside the full mesh: nothing waits for their connections
        # a learns of b from its handshake and dials it back.
        wait_for("a to connect to b",
                 lambda: {p["identity"] for p in a.peers() if p["state"] == "connected"} == {"b"})
        assert 0 < b.metric("kv_offload_store_capacity_bytes") <= 2 << 20
        assert a.rss_bytes() > 0
        with pytest.raises(ValueError, match="already has a sidecar called 'a'"):
            pool.add(identity="a", peers=[])
