"""Optional parts and their extras (kv_offload_sidecar/extras.py): the base install runs the tcp
sidecar without ucxx, NIXL, kopf or the Kubernetes client, and choosing a part whose extra is
missing is one line naming the extra. Each case runs ``kv-offload`` in a process where those
modules cannot be imported (``None`` in ``sys.modules``), as on a base install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kv_offload_sidecar.extras import EXTRAS, NIXL_PACKAGE, missing, require
from kv_offload_testing.local_pool import example_config, free_port_block
from test_main import wait_ready

# What a base install lacks (and the tools' own modules, which the image lacks too).
NOT_IN_THE_BASE = ("ucxx", "libucx", "nixl_cu12", "kopf", "kubernetes_asyncio", "torch", "matplotlib", "hypothesis",
                   "kv_offload_tools")
# Runs `kv-offload` with those modules hidden, after reporting any of them that got imported.
_SCRIPT = """import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from kv_offload_operator.cli import main
sys.exit(main(sys.argv[2:]))
"""


def base_install_cli(*argv: str) -> list[str]:
    return [sys.executable, "-c", _SCRIPT, ",".join(NOT_IN_THE_BASE), *argv]


@pytest.fixture
def sidecar_args(files, tmp_path) -> list[str]:
    return ["--config", files[0], "--pool-key-file", files[1], "--shm-dir", str(tmp_path),
            "--capacity-bytes", str(4 << 20)]


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ.copy())


def test_the_tcp_sidecar_runs_on_the_base_install(sidecar_args):
    port = free_port_block(1)
    proc = subprocess.Popen(base_install_cli("sidecar", *sidecar_args, "--transport", "tcp", "--host", "127.0.0.1",
                                             "--base-port", str(port), "--data-port", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, port)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, proc.stderr.read()


@pytest.mark.parametrize(("transport", "extra", "install"), [
    ("ucx", "'ucx' extra", "pip install 'kv-offload[ucx]'"),
    ("nixl", "'nixl' extra", f"pip install --no-deps {NIXL_PACKAGE}"),
])
def test_a_data_plane_whose_extra_is_missing_is_one_line_naming_it(sidecar_args, transport, extra, install):
    done = run(base_install_cli("sidecar", *sidecar_args, "--transport", transport))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1
    assert f"--transport {transport} needs" in done.stderr and extra in done.stderr and install in done.stderr


def test_the_operator_without_its_extra_is_one_line_naming_it():
    done = run(base_install_cli("operator", "--namespace", "default"))
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("kv-offload operator needs kopf, which is not installed (the 'operator' extra): "
                           "pip install 'kv-offload[operator]'\n")


def test_ucx_info_without_the_ucx_extra_is_one_line_naming_it():
    done = run(base_install_cli("ucx-info"))
    assert (done.returncode, done.stderr) == (2, "kv-offload ucx-info needs libucx, which is not installed "
                                                 "(the 'ucx' extra): pip install 'kv-offload[ucx]'\n")


def test_a_tool_without_its_extra_is_one_line_naming_it():
    done = run(base_install_cli("demo"))
    assert done.returncode == 2, done.stderr
    assert "(the 'demo' extra): pip install 'kv-offload[demo]' from a checkout" in done.stderr


def test_the_translation_commands_run_on_the_base_install(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(example_config().to_json())
    done = run(base_install_cli("fingerprint", str(config)))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == example_config().fingerprint
    assert second.startswith("model identity (command line): ")


def test_every_optional_module_names_an_extra_of_pyproject():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert {extra for extra, _ in EXTRAS.values()} <= extras.keys()
    assert extras["nixl"] == [NIXL_PACKAGE]
    assert missing("ucxx", "--transport ucx") == (
        "--transport ucx needs ucxx, which is not installed (the 'ucx' extra): pip install 'kv-offload[ucx]'")
    require("--transport ucx", "ucxx")  # installed here (./dev installs every extra)
