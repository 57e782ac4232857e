"""The sidecar process runs with glibc's non-temporal copy threshold below its chunk pieces."""

from __future__ import annotations

import os
import subprocess
import sys

from kv_offload_sidecar.bulk_copies import (
    MAX_COPY_THREADS,
    NON_TEMPORAL_THRESHOLD,
    NON_TEMPORAL_TUNABLE,
    SWITCH_INTERVAL_SECONDS,
    applies_here,
    copy_threads,
    tunables_with_threshold,
)
from kv_offload_sidecar.store.engine_region import COPY_PIECE_BYTES

SHOW_TUNABLES_AFTER_REEXEC = (
    "import os, sys\n"
    "from kv_offload_sidecar.bulk_copies import prepare_for_bulk_copies\n"
    "print('start', os.getpid(), flush=True)\n"
    "prepare_for_bulk_copies()\n"
    "print('switch', sys.getswitchinterval())\n"
    "print('tunables', os.getpid(), os.environ.get('GLIBC_TUNABLES', ''))\n"
)


def test_threshold_is_added_beside_the_users_own_tunables() -> None:
    tunables = tunables_with_threshold({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert tunables == f"glibc.malloc.arena_max=2:{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD:#x}"


def test_a_threshold_the_user_set_is_kept() -> None:
    assert tunables_with_threshold({"GLIBC_TUNABLES": f"{NON_TEMPORAL_TUNABLE}=0x4040"}) is None


def test_chunk_pieces_are_at_or_above_the_threshold() -> None:
    assert COPY_PIECE_BYTES >= NON_TEMPORAL_THRESHOLD


def test_the_process_reexecutes_once_where_the_tunable_exists_and_always_shortens_the_switch() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", SHOW_TUNABLES_AFTER_REEXEC], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    starts = [line.split()[1] for line in lines if line.startswith("start")]
    tunables = [line.split(maxsplit=2) for line in lines if line.startswith("tunables")]
    assert len(tunables) == 1 and tunables[0][1] == starts[0], done.stdout
    assert f"switch {SWITCH_INTERVAL_SECONDS}" in lines
    if applies_here():  # x86-64 glibc: one re-execution, same PID, the threshold set
        assert len(starts) == 2 and starts[0] == starts[1], done.stdout
        assert f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD:#x}" in tunables[0][2]
    else:  # elsewhere the tunable does not exist: no re-execution, nothing added
        assert len(starts) == 1 and len(tunables[0]) == 2, done.stdout


def test_copy_threads_follow_the_cores_the_process_may_use() -> None:
    code = ("import os\n"
            "from kv_offload_sidecar.bulk_copies import copy_threads\n"
            "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "print(copy_threads())\n")
    one_core = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)
    assert one_core.stdout.split() == ["1"]
    assert 1 <= copy_threads() <= min(MAX_COPY_THREADS, len(os.sched_getaffinity(0)))
