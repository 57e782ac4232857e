"""`kv-offload sidecar`: flags, environment defaults, one-line errors, graceful SIGTERM."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from kv_offload_sidecar.local_pool import LocalPool, example_config, sidecar_command
from kv_offload_sidecar.main import add_arguments, build_settings


@pytest.fixture
def files(tmp_path):
    config = tmp_path / "offloading_config.json"
    config.write_text(example_config().to_json())
    key = tmp_path / "pool.key"
    key.write_bytes(b"k3y\n")
    return str(config), str(key)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def run_cli(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*sidecar_command(), "sidecar", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_side_channel_env_gives_host_and_base_port(files, monkeypatch):
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "6000")
    s = build_settings(parse(["--config", files[0], "--pool-key-file", files[1], "--dp-indices", "4,5"]))
    assert (s.host, s.base_port, s.control_ports) == ("10.1.2.3", 6000, (6004, 6005))
    assert s.pool_key == b"k3y"


def test_flags_win_over_env_and_dp_index_defaults_to_the_config(files, monkeypatch):
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "6000")
    s = build_settings(parse(["--config", files[0], "--pool-key-file", files[1], "--base-port", "7000",
                              "--peers", "a:1,b:2", "--fetch-deadline-seconds", "0.5"]))
    assert s.base_port == 7000 and s.dp_indices == (0,) and s.static_peers == ("a:1", "b:2")
    assert s.fetch_deadline_seconds == 0.5


def test_hash_seed_follows_pythonhashseed_unless_config_pins_it(files, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    assert build_settings(parse(["--config", files[0], "--pool-key-file", files[1]])).hash_seed == "99"
    pinned = tmp_path / "pinned.json"
    pinned.write_text(example_config(extra_config={"hash_seed": "1234"}).to_json())
    assert build_settings(parse(["--config", str(pinned), "--pool-key-file", files[1]])).hash_seed == "1234"


@pytest.mark.parametrize("extra, phrase", [
    (["--pool-key-file", "/nonexistent/key"], "pool key file '/nonexistent/key' does not exist"),
    (["--dp-indices", "a,b"], "--dp-indices"),
    (["--peers", "nocolon"], "is not host:port"),
    (["--capacity-bytes", "0"], "capacity_bytes"),
    (["--shm-dir", "/nonexistent/shm"], "is not a directory"),
])
def test_bad_input_exits_2_with_one_line(files, extra, phrase):
    argv = ["--config", files[0], "--pool-key-file", files[1], *extra]
    proc = run_cli(argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert any(phrase in line for line in lines), proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kv-offload sidecar:")


def test_bad_config_file_exits_2(tmp_path, files):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    proc = run_cli(["--config", str(bad), "--pool-key-file", files[1]])
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr and len(proc.stderr.splitlines()) == 1


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
