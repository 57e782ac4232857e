"""`kv-offload ucx-info` (ucx_transports.py): the UCX ucxx loads, its compiled-in transports, and the
switch to another UCX installation that the image uses for RDMA."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kv_offload_sidecar.commands import ucx_info as ucx

KV_OFFLOAD = str(Path(sys.executable).with_name("kv-offload"))


def ucx_info(*args: str, env: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """Run the real CLI; (exit code, parsed JSON stdout, stderr)."""
    done = subprocess.run([KV_OFFLOAD, "ucx-info", "--json", *args], check=False, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **(env or {})))
    return done.returncode, json.loads(done.stdout) if done.stdout else None, done.stderr


@pytest.fixture(scope="module")
def wheel_lib() -> Path:
    import libucx

    return Path(libucx.__file__).parent / "lib"


def test_the_wheels_ucx_has_shared_memory_and_tcp_but_no_rdma_transport(wheel_lib: Path) -> None:
    code, report, err = ucx_info()
    assert code == 0, err
    assert report["library_dir"] == str(wheel_lib)
    assert report["version"] == report["wheel_version"] == __import__("libucx").__version__
    assert {"cma", "posix", "sysv", "tcp", "self"} <= set(report["transports"])
    assert not {"rc_verbs", "rc_mlx5", "dc_mlx5", "rdmacm"} & set(report["transports"])
    assert "--without-verbs" in report["configured_with"] and "--without-rdmacm" in report["configured_with"]
    # The wheel ships ucx_info: what this host can use, with its devices (loopback at least).
    assert "lo" in report["devices"]["tcp"]
    assert tuple(report["memlock"]) == resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert {os.path.dirname(p) for p in report["loaded"]} == {str(wheel_lib)}


def test_require_names_a_missing_rdma_transport_in_one_line_and_exits_1() -> None:
    code, report, err = ucx_info("--require", "rc,rdmacm,tcp")
    assert code == 1 and report["missing"] == ["rc", "rdmacm"]
    (line,) = err.strip().splitlines()
    assert line.startswith(f"kv-offload ucx-info: UCX {report['version']} from {report['library_dir']} has no "
                           f"rc, rdmacm transport")
    assert "LD_LIBRARY_PATH=/opt/ucx/lib" in line
    assert ucx_info("--require", "sm,tcp,cma,self", "--match-wheel")[0] == 0


def test_the_image_switch_makes_ucxx_load_the_ucx_on_the_library_path_and_its_modules(
        wheel_lib: Path, tmp_path: Path) -> None:
    """The Dockerfile's ENV (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true, LD_LIBRARY_PATH=<ucx>/lib)
    applied to another UCX tree: a copy of the wheel's without its cma module."""
    other = tmp_path / "ucx" / "lib"
    shutil.copytree(wheel_lib, other, symlinks=True)
    for module in (other / "ucx").glob("libuct_cma*"):
        module.unlink()
    env = {"RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true", "LD_LIBRARY_PATH": str(other)}
    code, report, err = ucx_info(env=env)
    assert code == 0, err
    assert report["library_dir"] == str(other) and report["module_dir"] == str(other / "ucx")
    assert {os.path.dirname(p) for p in report["loaded"]} == {str(other)}
    assert "cma" not in report["modules"] and "cma" not in report["transports"]
    assert report["devices"] is None  # no bin/ucx_info beside this tree
    # ucxx itself, in a process with that environment, maps only that tree and cannot use cma.
    probe = ("import os, re, ucxx._lib.libucxx as u\n"
             "os.environ['UCX_TLS'] = 'cma,tcp,self'\n"
             "u.UCXContext()\n"
             "import json; print('MAPPED', json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps')\n"
             "                                                if re.search(r'/libuc[pst]', l)})))\n")
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))
    assert done.returncode == 0, done.stderr
    (mapped,) = [json.loads(line[len("MAPPED "):]) for line in done.stdout.splitlines() if line.startswith("MAPPED ")]
    assert mapped and all(path.startswith(str(other)) for path in mapped)
    assert "transport 'cma' is not available" in done.stdout + done.stderr  # UCX logs to stdout
    # Without the switch the same LD_LIBRARY_PATH changes nothing: the wheel's UCX is loaded.
    code, report, _ = ucx_info(env={"LD_LIBRARY_PATH": str(other)})
    assert code == 0 and report["library_dir"] == str(wheel_lib)


def test_ucx_libraries_from_two_directories_are_a_problem_and_a_foreign_release_too() -> None:
    maps = ("7f0 r-xp 0 08:01 1 /opt/ucx/lib/libucs.so.0.0.0\n"
            "7f1 r-xp 0 08:01 2 /site/libucx/lib/libucp.so\n"
            "7f2 r-xp 0 08:01 3 /opt/ucx/lib/ucx/libuct_ib.so.0\n"
            "7f3 r-xp 0 08:01 4 /usr/lib/libc.so.6\n")
    loaded = ucx.mapped_ucx_libraries(maps)
    assert loaded == ("/opt/ucx/lib/libucs.so.0.0.0", "/site/libucx/lib/libucp.so")
    report = ucx.UcxReport(version="1.22.0", library_dir="/opt/ucx/lib", loaded=loaded, module_dir="/opt/ucx/lib/ucx",
                           modules=("ib", "rdmacm"), transports=ucx.compiled_transports(("ib", "rdmacm")),
                           wheel_version="1.21.0")
    found = ucx.problems(report, match_wheel=True)
    assert found[0].startswith("UCX libraries are loaded from 2 directories")
    assert found[1] == ("UCX 1.22.0 from /opt/ucx/lib is not the release of the libucx wheel ucxx was built with "
                        "(1.21.0); build the same release (Dockerfile ARG UCX_VERSION)")
    assert ucx.problems(report, match_wheel=False) == found[:1]


def test_modules_give_their_transports_and_aliases_are_satisfied_by_any_of_theirs(tmp_path: Path) -> None:
    for name in ("libuct_ib.so.0", "libuct_ib_mlx5.so.0.0.0", "libuct_rdmacm.so", "libucm_cuda.so", "README"):
        (tmp_path / name).write_bytes(b"")
    modules = ucx.modules_in(str(tmp_path))
    assert modules == ("ib", "ib_mlx5", "rdmacm")
    transports = ucx.compiled_transports(modules)
    assert {"rc_verbs", "ud_verbs", "rc_mlx5", "dc_mlx5", "rdmacm", "tcp", "posix"} <= set(transports)
    assert ucx.missing_transports(["rc", "dc", "ud", "sm", "rdmacm", "cma", "cuda"], transports, modules) == \
        ("cma", "cuda")


def test_ucx_info_device_listing_is_parsed_per_transport() -> None:
    text = ("#      Transport: rc_verbs\n#         Device: mlx5_0:1\n#      Transport: rc_verbs\n"
            "#         Device: mlx5_1:1\n#      Transport: tcp\n#         Device: eth0\n#         Device: lo\n")
    assert ucx.parse_ucx_info_devices(text) == {"rc_verbs": ["mlx5_0:1", "mlx5_1:1"], "tcp": ["eth0", "lo"]}
