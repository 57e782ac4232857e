"""`kv-offload sidecar`: flags, environment defaults, one-line errors, graceful SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess

import pytest
from kv_offload_sidecar.commands.sidecar import add_arguments, build_settings
from kv_offload_sidecar.setting_flags import leaf_fields
from kv_offload_sidecar.settings import GROUPS, SidecarSettings
from kv_offload_testing.http_client import http_json
from kv_offload_testing.local_pool import (
    LocalPool,
    example_config,
    free_port_block,
    sidecar_command,
)
from refusal import refusal
from waiting import wait_for


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def run_cli(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*sidecar_command(), "sidecar", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def refused(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The one stderr line of ``kv-offload sidecar argv``, once it exited 2 with nothing on stdout."""
    return refusal([*sidecar_command(), "sidecar"], *argv, env={**os.environ, **(env or {})})


def test_side_channel_env_gives_host_and_base_port(files, monkeypatch):
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "6000")
    s = build_settings(parse(["--config", files[0], "--pool-key-file", files[1], "--dp-indices", "4,5"]))
    assert (s.network.host, s.network.base_port, s.network.control_ports) == ("10.1.2.3", 6000, (6004, 6005))
    assert s.security.pool_key == b"k3y"


def test_a_sidecar_given_only_its_config_and_key_runs_every_setting_at_its_declared_default(files, monkeypatch):
    for name in ("VLLM_P2P_SIDE_CHANNEL_HOST", "VLLM_P2P_SIDE_CHANNEL_PORT", "PYTHONHASHSEED"):
        monkeypatch.delenv(name, raising=False)
    s = build_settings(parse(["--config", files[0], "--pool-key-file", files[1]]))
    given = {"config", "pool_key", "pool_key_file", "identity"}
    for group, f in leaf_fields(SidecarSettings):
        if f.name not in given:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert getattr(getattr(s, group), f.name) == default, f"{group}.{f.name}"
    assert s.data_plane.transport == "ucx"  # the pool's default too: UCX, with tcp where UCX is unavailable


def test_every_flag_shows_its_settings_default_in_its_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert "(default 5810)" in helps["data_port"] and "(default ucx)" in helps["transport"]
    assert "(default drop)" in helps["peer_copies"] and "(default 1073741824)" in helps["capacity_bytes"]
    assert "dns_interval_seconds" not in helps  # a constant: nobody passed --dns-interval-seconds


def test_every_settings_flag_is_in_one_group_and_help_shows_it_there():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shown = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for g in GROUPS:
        assert set(g.fields) <= shown[g.name], g.name
    assert {"ucx_tls", "data_lanes_alias", "ucx_lanes"} <= shown["data_plane"]
    assert {"parent_pid", "log_level"} <= shown["process"]
    help_text = parser.format_help()
    data_plane = help_text[help_text.index("\ndata_plane:"):help_text.index("\npeers:")]
    assert "--transport" in data_plane and "--lanes" in data_plane and "--peers-dns" not in data_plane


def test_lanes_is_one_count_of_streams_that_each_plane_maps(files, monkeypatch):
    from kv_offload_sidecar.commands.sidecar import ucx_lanes
    from kv_offload_sidecar.data.lanes import lanes_offered

    monkeypatch.delenv("KV_OFFLOAD_UCX_LANES", raising=False)
    for lanes, ucx in ((0, 1), (1, 1), (2, 2), (4, 2), (8, 2)):
        args = parse(["--config", files[0], "--pool-key-file", files[1], "--lanes", str(lanes)])
        s = build_settings(args)
        assert s.data_plane.lanes == lanes
        assert ucx_lanes(args, s.data_plane.lanes) == ucx  # ucx runs 1 or 2 connections
        if lanes:
            assert lanes_offered(s.data_plane.lanes) == lanes  # tcp connections, nixl read threads
    with pytest.raises(ValueError, match="lanes 9 must be 0"):
        build_settings(parse(["--config", files[0], "--pool-key-file", files[1], "--lanes", "9"]))


def test_data_lanes_is_a_deprecated_alias_of_lanes_that_warns(files, caplog):
    with caplog.at_level("WARNING"):
        s = build_settings(parse(["--config", files[0], "--pool-key-file", files[1], "--data-lanes", "3"]))
    assert s.data_plane.lanes == 3
    assert "--data-lanes is deprecated: use --lanes 3" in caplog.text
    with pytest.raises(ValueError, match="--data-lanes 3 and --lanes 2 disagree"):
        build_settings(parse(["--config", files[0], "--pool-key-file", files[1],
                              "--data-lanes", "3", "--lanes", "2"]))


def test_ucx_lanes_is_deprecated_and_still_wins_over_the_mapping_with_a_warning(files, caplog, monkeypatch):
    from kv_offload_sidecar.commands.sidecar import ucx_lanes

    monkeypatch.delenv("KV_OFFLOAD_UCX_LANES", raising=False)
    with caplog.at_level("WARNING"):
        assert ucx_lanes(parse(["--config", files[0], "--pool-key-file", files[1], "--ucx-lanes", "2"]), 0) == 2
    assert "--ucx-lanes is deprecated: use --lanes 2" in caplog.text
    monkeypatch.setenv("KV_OFFLOAD_UCX_LANES", "1")
    assert ucx_lanes(parse(["--config", files[0], "--pool-key-file", files[1]]), 8) == 1


def test_flags_win_over_env_and_dp_index_defaults_to_the_config(files, monkeypatch):
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "6000")
    s = build_settings(parse(["--config", files[0], "--pool-key-file", files[1], "--base-port", "7000",
                              "--peers", "a:1,b:2", "--fetch-deadline-seconds", "0.5"]))
    assert s.network.base_port == 7000 and s.network.dp_indices == (0,) and s.peers.static_peers == ("a:1", "b:2")
    assert s.peers.fetch_deadline_seconds == 0.5


def test_hash_seed_follows_pythonhashseed_unless_config_pins_it(files, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    assert build_settings(parse(["--config", files[0], "--pool-key-file", files[1]])).pool.hash_seed == "99"
    pinned = tmp_path / "pinned.json"
    pinned.write_text(example_config(extra_config={"hash_seed": "1234"}).to_json())
    assert build_settings(parse(["--config", str(pinned), "--pool-key-file", files[1]])).pool.hash_seed == "1234"


@pytest.mark.parametrize("extra, phrase", [
    (["--pool-key-file", "/nonexistent/key"], "pool key file '/nonexistent/key' does not exist"),
    (["--dp-indices", "a,b"], "--dp-indices"),
    (["--peers", "nocolon"], "is not host:port"),
    (["--capacity-bytes", "0"], "capacity_bytes"),
    (["--shm-dir", "/nonexistent/shm"], "is not a directory"),
])
def test_bad_input_exits_2_with_one_line(files, extra, phrase):
    argv = ["--config", files[0], "--pool-key-file", files[1], *extra]
    line = refused(argv)
    assert line.startswith("kv-offload sidecar:") and phrase in line, line


def test_bad_config_file_exits_2(tmp_path, files):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert "not valid JSON" in refused(["--config", str(bad), "--pool-key-file", files[1]])


def test_sigterm_exits_0_and_unlinks_shared_memory():
    pool = LocalPool(1, workdir=None).start()
    workdir = pool.workdir
    try:
        status = pool[0].status()
        store_path = status["store"]["path"]
        assert os.path.exists(store_path)
        assert pool[0].terminate() == 0
        leftovers = [f for f in os.listdir(workdir) if f.endswith((".slots", ".sock"))]
        assert leftovers == []
    finally:
        pool.stop()


def test_hash_seed_flag_wins_over_config_and_pythonhashseed(files, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    pinned = tmp_path / "pinned.json"
    pinned.write_text(example_config(extra_config={"hash_seed": "1234"}).to_json())
    for config in (files[0], str(pinned)):
        s = build_settings(parse(["--config", config, "--pool-key-file", files[1], "--hash-seed", "s33d"]))
        assert s.pool.hash_seed == "s33d"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert build_settings(parse(["--config", files[0], "--pool-key-file", files[1]])).pool.hash_seed == "0"


def test_empty_hash_seed_flag_exits_2_with_one_line(files):
    assert refused(["--config", files[0], "--pool-key-file", files[1], "--hash-seed", ""]) == (
        "kv-offload sidecar: --hash-seed is empty: give the pool's seed (e.g. 0) or leave the flag out")


@pytest.mark.parametrize("flag, env", [(["--ucx-tls", "bogus_tl"], "tcp,self"), ([], "bogus_tl")],
                         ids=["flag", "env"])
def test_unusable_ucx_tls_from_flag_or_env_stops_ucx_sidecar_with_one_line(files, flag, env):
    argv = ["--config", files[0], "--pool-key-file", files[1], "--transport", "ucx", "--host", "127.0.0.1",
            "--base-port", str(free_port_block(1)), "--data-port", "0", *flag]
    proc = run_cli(argv, env={"UCX_TLS": env})
    assert proc.returncode == 1 and proc.stdout == ""
    # UCX logs its own complaint (to stderr); ours is one line naming the setting to change.
    ours = [line for line in proc.stderr.splitlines() if line.startswith("kv-offload sidecar:")]
    assert len(ours) == 1 and "UCX_TLS='bogus_tl'" in ours[0] and "--ucx-tls" in ours[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_rdma_asked_of_a_ucx_built_without_it_stops_the_ucx_sidecar_with_one_line(files):
    """The libucx wheel (this venv's UCX) has no verbs: a pool's rdma-rc preset must not run
    silently over tcp on it."""
    argv = ["--config", files[0], "--pool-key-file", files[1], "--transport", "ucx", "--host", "127.0.0.1",
            "--base-port", str(free_port_block(1)), "--data-port", "0", "--ucx-tls", "rc,sm,self,tcp"]
    line = refused(argv)
    assert line.startswith("kv-offload sidecar: UCX_TLS='rc,sm,self,tcp' asks for rc, which the UCX")
    assert "UCX_TARBALL" in line and "--ucx-tls" in line


@pytest.mark.parametrize("flag, env, named", [(["--ucx-lanes", "3"], None, "--ucx-lanes '3'"),
                                              ([], {"KV_OFFLOAD_UCX_LANES": "two"},
                                               "KV_OFFLOAD_UCX_LANES 'two'")], ids=["flag", "env"])
def test_bad_ucx_lane_count_exits_2_with_one_line_naming_the_choices(files, flag, env, named):
    argv = ["--config", files[0], "--pool-key-file", files[1], "--transport", "ucx", "--host", "127.0.0.1",
            "--base-port", str(free_port_block(1)), "--data-port", "0", *flag]
    assert refused(argv, env=env) == (
        f"kv-offload sidecar: {named} is not a lane count; use 1 (the holder copies every chunk) "
        "or 2 (the fetcher copies every third chunk too)")


def test_ucx_tls_flag_wins_over_env():
    with LocalPool(2, transport="ucx", env={"UCX_TLS": "bogus_tl"},
                   extra_args=("--ucx-tls", "tcp,self")) as pool:
        assert [s.status()["transport"] for s in pool.sidecars] == ["ucx", "ucx"]


def test_sidecar_shuts_down_when_its_parent_pid_is_gone(files, shm_dir):
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    argv = ["--config", files[0], "--pool-key-file", files[1], "--host", "127.0.0.1", "--shm-dir", shm_dir,
            "--base-port", str(free_port_block(1)), "--data-port", "0", "--parent-pid", str(gone.pid)]
    proc = run_cli(argv)
    assert proc.returncode == 1 and f"parent process {gone.pid} is already gone" in proc.stderr
    bad = run_cli([*argv[:-1], "abc"])
    assert bad.returncode == 2 and "--parent-pid 'abc' is not a process id" in bad.stderr


def test_sidecar_stops_gracefully_when_a_watched_non_parent_process_exits(files, shm_dir):
    watched = subprocess.Popen(["sleep", "600"])
    port = free_port_block(1)
    argv = [*sidecar_command(), "sidecar", "--config", files[0], "--pool-key-file", files[1],
            "--host", "127.0.0.1", "--shm-dir", shm_dir, "--base-port", str(port), "--data-port", "0",
            "--capacity-bytes", str(1 << 20), "--identity", "watcher", "--transport", "tcp"]
    sidecar = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "KV_OFFLOAD_PARENT_PID": str(watched.pid)})
    try:
        wait_ready(sidecar, port)
        assert os.path.exists(os.path.join(shm_dir, "kv-offload-watcher.slots"))
        watched.kill()
        watched.wait(10)
        assert sidecar.wait(30) == 0
        assert f"parent process {watched.pid} is gone" in sidecar.stderr.read()
        assert not os.path.exists(os.path.join(shm_dir, "kv-offload-watcher.slots"))
    finally:
        for proc in (watched, sidecar):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def wait_ready(proc: subprocess.Popen[str], port: int) -> None:
    """Until the sidecar on ``port`` answers /readyz with 200 (fails if it exits first)."""

    def ready() -> bool:
        assert proc.poll() is None, f"sidecar exited with {proc.returncode}: {proc.stderr.read()}"
        try:
            return http_json(f"http://127.0.0.1:{port}/readyz", timeout=1.0)[0] == 200
        except OSError:
            return False

    wait_for(f"the sidecar on port {port} ready", ready)
