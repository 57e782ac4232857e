"""The sidecar's CPU budget (cpu_budget.py), read from fabricated /proc and cgroup trees,
and every lane and thread pool following it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from kv_offload_sidecar.bulk_copies import MAX_COPY_THREADS, copy_threads
from kv_offload_sidecar.cpu_budget import CPU_REQUEST_ENV, CpuBudget, cpu_budget, read_cpu_budget
from kv_offload_sidecar.data.checksum_threads import checksum_threads
from kv_offload_sidecar.data.lanes import lanes_offered
from kv_offload_sidecar.data.tcp.stream_worker import spare_core
from kv_offload_sidecar.settings import MAX_DATA_LANES

V2_MOUNT = "31 23 0:28 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU_MOUNT = ("34 31 0:31 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:9 - "
                "cgroup cgroup rw,cpu,cpuacct")
HYBRID_V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"


def tree(tmp_path: Path, cgroup: str, mountinfo: str, files: Mapping[str, str]) -> tuple[Path, Path]:
    """(proc, cgroup root) fabricated under ``tmp_path``: ``/proc/self/cgroup``,
    ``/proc/self/mountinfo`` and ``files`` (paths under /sys/fs/cgroup)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


def budget(tmp_path: Path, cgroup: str, mountinfo: str, files: Mapping[str, str], *, affinity: int = 16,
           environ: Mapping[str, str] | None = None) -> CpuBudget:
    proc, root = tree(tmp_path, cgroup, mountinfo, files)
    return read_cpu_budget(proc, root, environ=environ or {}, affinity=affinity)


def test_cgroup_v2_parent_quota_smaller_than_the_childs_sets_the_budget(tmp_path: Path) -> None:
    got = budget(tmp_path, "0::/kubepods/pod1/c1\n", V2_MOUNT, {
        "kubepods/pod1/c1/cpu.max": "400000 100000\n",
        "kubepods/pod1/cpu.max": "250000 100000\n",
        "kubepods/cpu.max": "max 100000\n"})
    assert got == CpuBudget(2, "cgroup v2 /kubepods/pod1 cpu.max 250000 100000")


def test_cgroup_v2_own_quota_is_rounded_down_and_never_below_one(tmp_path: Path) -> None:
    files = {"kubepods/c1/cpu.max": "350000 100000\n", "kubepods/cpu.max": "max 100000\n"}
    assert budget(tmp_path / "a", "0::/kubepods/c1\n", V2_MOUNT, files) == \
        CpuBudget(3, "cgroup v2 /kubepods/c1 cpu.max 350000 100000")
    half = budget(tmp_path / "b", "0::/c1\n", V2_MOUNT, {"c1/cpu.max": "50000 100000\n"})
    assert half.cpus == 1


def test_cgroup_v1_unlimited_leaf_takes_its_parents_limit(tmp_path: Path) -> None:
    # Hybrid host: the cpu controller is on v1; the v2 tree (no controllers) is not read.
    got = budget(tmp_path, "4:cpu,cpuacct:/kubepods/pod1/c1\n2:memory:/kubepods/pod1/c1\n0::/\n",
                 "\n".join([V1_CPU_MOUNT.format(root="/"), HYBRID_V2_MOUNT]), {
                     "cpu,cpuacct/kubepods/pod1/c1/cpu.cfs_quota_us": "-1\n",
                     "cpu,cpuacct/kubepods/pod1/c1/cpu.cfs_period_us": "100000\n",
                     "cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "300000\n",
                     "cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000\n",
                     "unified/cpu.max": "100000 100000\n"})
    assert got == CpuBudget(3, "cgroup v1 /kubepods/pod1 cpu.cfs_quota_us 300000 cpu.cfs_period_us 100000")


def test_cgroup_v1_mount_of_the_containers_own_cgroup_is_read_at_its_mount_point(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: the container's cgroup is mounted as the hierarchy's root.
    got = budget(tmp_path, "3:cpu:/docker/abc\n", V1_CPU_MOUNT.format(root="/docker/abc"), {
        "cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert got == CpuBudget(2, "cgroup v1 /docker/abc cpu.cfs_quota_us 200000 cpu.cfs_period_us 100000")


def test_affinity_below_the_quota_sets_the_budget_and_names_both(tmp_path: Path) -> None:
    got = budget(tmp_path, "0::/c1\n", V2_MOUNT, {"c1/cpu.max": "400000 100000\n"}, affinity=2)
    assert got == CpuBudget(2, "affinity 2 cpus (below cgroup v2 /c1 cpu.max 400000 100000)")


def test_the_containers_request_is_the_budget_where_no_limit_is_set(tmp_path: Path) -> None:
    unlimited = {"kubepods/c1/cpu.max": "max 100000\n"}
    got = budget(tmp_path / "a", "0::/kubepods/c1\n", V2_MOUNT, unlimited, environ={CPU_REQUEST_ENV: "2500"})
    assert got == CpuBudget(2, f"CPU request 2500m ({CPU_REQUEST_ENV})")
    small = budget(tmp_path / "b", "0::/kubepods/c1\n", V2_MOUNT, unlimited, environ={CPU_REQUEST_ENV: "250"})
    assert small.cpus == 1
    unset = budget(tmp_path / "c", "0::/kubepods/c1\n", V2_MOUNT, unlimited, affinity=6,
                   environ={CPU_REQUEST_ENV: "0"})  # the downward API's value for no request
    assert unset == CpuBudget(6, "affinity 6 cpus (no CPU limit or request)")


def test_a_limit_wins_over_the_request(tmp_path: Path) -> None:
    got = budget(tmp_path, "0::/c1\n", V2_MOUNT, {"c1/cpu.max": "300000 100000\n"},
                 environ={CPU_REQUEST_ENV: "1000"})
    assert got.cpus == 3 and got.source.startswith("cgroup v2")


def test_malformed_files_are_skipped_with_one_log_line_each(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kv_offload_sidecar.cpu_budget")
    got = budget(tmp_path, "0::/kubepods/c1\n", V2_MOUNT, {
        "kubepods/c1/cpu.max": "banana\n", "kubepods/cpu.max": "200000 100000\n"},
        environ={CPU_REQUEST_ENV: "1.5"})
    assert (got.cpus, got.source) == (2, "cgroup v2 /kubepods cpu.max 200000 100000")
    assert len(got.ignored) == 1 and "kubepods/c1/cpu.max holds 'banana'" in got.ignored[0]
    assert "'max PERIOD' or 'QUOTA PERIOD'" in got.ignored[0]
    assert [r.getMessage() for r in caplog.records] == [f"CPU budget: {got.ignored[0]}"]

    only_request = budget(tmp_path / "r", "0::/c1\n", V2_MOUNT, {"c1/cpu.max": "0 0\n"}, affinity=4,
                          environ={CPU_REQUEST_ENV: "1.5"})
    assert (only_request.cpus, len(only_request.ignored)) == (4, 2)
    assert f"{CPU_REQUEST_ENV}='1.5' ignored: expected whole millicores" in only_request.ignored[1]


def test_without_cgroup_files_the_budget_is_the_affinity(tmp_path: Path) -> None:
    missing = read_cpu_budget(tmp_path / "no-proc", tmp_path / "no-cgroup", environ={}, affinity=3)
    assert (missing.cpus, missing.source) == (3, "affinity 3 cpus (no CPU limit or request)")
    assert "unreadable" in missing.ignored[0]
    root_only = budget(tmp_path / "r", "0::/\n", V2_MOUNT, {}, affinity=5)  # the root cgroup has no cpu.max
    assert root_only == CpuBudget(5, "affinity 5 cpus (no CPU limit or request)")


def test_the_budget_is_read_once_and_again_after_cache_clear() -> None:
    before = os.sched_getaffinity(0)
    cpu_budget.cache_clear()
    try:
        first = cpu_budget()
        os.sched_setaffinity(0, {min(before)})
        assert cpu_budget() is first
        cpu_budget.cache_clear()
        assert cpu_budget().cpus == 1
    finally:
        os.sched_setaffinity(0, before)
        cpu_budget.cache_clear()


def test_every_lane_and_thread_pool_follows_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # One core; all cores; all cores with a one-core request (the budget where no limit is set).
    before = os.sched_getaffinity(0)
    try:
        for cores, request in (({min(before)}, None), (before, None), (before, "1000")):
            os.sched_setaffinity(0, cores)
            if request is None:
                monkeypatch.delenv(CPU_REQUEST_ENV, raising=False)
            else:
                monkeypatch.setenv(CPU_REQUEST_ENV, request)
            cpu_budget.cache_clear()
            cpus = cpu_budget().cpus
            assert cpus == read_cpu_budget().cpus
            assert lanes_offered(0) == checksum_threads() == min(MAX_DATA_LANES, cpus)
            assert copy_threads() == min(MAX_COPY_THREADS, cpus)
            assert spare_core() == (cpus > 1)
    finally:
        os.sched_setaffinity(0, before)
        monkeypatch.delenv(CPU_REQUEST_ENV, raising=False)
        cpu_budget.cache_clear()
