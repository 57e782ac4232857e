"""./dev's set-up: helm and kubectl at the pinned versions, from PATH when they are there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEV = (REPO / "dev").read_text()
HELM_VERSION = re.search(r'^HELM_VERSION="([^"]+)"', DEV, re.MULTILINE).group(1)
KUBECTL_VERSION = re.search(r'^KUBECTL_VERSION="([^"]+)"', DEV, re.MULTILINE).group(1)


def fake_tools(bindir: Path, helm: str, kubectl: str) -> None:
    """helm and kubectl scripts that print the version lines of the real ones."""
    bindir.mkdir(parents=True)
    for name, line in (("helm", f"{helm}+g05fa379"), ("kubectl", f"Client Version: {kubectl}")):
        path = bindir / name
        path.write_text(f"#!/bin/sh\necho '{line}'\necho 'Kustomize Version: v5.7.1'\n")
        path.chmod(0o755)


def ensure_helm(checkout: Path, path: str) -> subprocess.CompletedProcess[str]:
    """``ensure_helm`` of a copy of ./dev in ``checkout`` (its .venv/bin empty), with ``path``."""
    (checkout / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(REPO / "dev", checkout / "dev")
    return subprocess.run(["bash", "-c", "source ./dev && ensure_helm"], cwd=checkout, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PATH": path})


def test_helm_and_kubectl_on_path_at_the_pinned_versions_are_used(tmp_path):
    fake_tools(tmp_path / "older", "v3.16.0", "v1.32.4-dispatcher")
    fake_tools(tmp_path / "pinned", HELM_VERSION, KUBECTL_VERSION)
    path = f"{tmp_path / 'older'}:{tmp_path / 'pinned'}:{os.environ['PATH']}"
    done = ensure_helm(tmp_path / "checkout", path)
    assert done.returncode == 0, done.stderr
    for name in ("helm", "kubectl"):
        assert os.readlink(tmp_path / "checkout" / ".venv" / "bin" / name) == str(tmp_path / "pinned" / name)
    assert "from PATH" in done.stderr


@pytest.mark.parametrize("name", ["helm", "kubectl"])
def test_the_pins_are_the_versions_the_unpacked_binaries_report(name):
    binary = REPO / ".venv" / "bin" / name
    if not binary.exists():
        binary = Path(shutil.which(name) or name)
    done = subprocess.run(["bash", "-c", f"source ./dev && tool_version {binary}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().split("+")[0] == (HELM_VERSION if name == "helm" else KUBECTL_VERSION)


# ---- ./dev demo: the base package and the demo's extra, nothing more -------------------------
DEMO_EXTRAS = set(re.search(r'^DEMO_EXTRAS="([^"]*)"', DEV, re.MULTILINE).group(1).split(","))
# What a tcp demo must never pull in: the other data planes, the operator's runtime, the test tools.
NOT_FOR_THE_DEMO = {"ucxx-cu12", "nixl-cu12", "kopf", "kubernetes-asyncio", "transformers", "matplotlib",
                    "hypothesis", "pytest"}
# sitecustomize for every process of the demo (sidecars included): a module of a distribution
# outside the demo's install set is absent.
BLOCKER = '''
import os, sys
# A None entry is what an absent module looks like: import raises ModuleNotFoundError, find_spec is None.
for name in os.environ["KV_OFFLOAD_TEST_BLOCKED"].split(","):
    sys.modules.setdefault(name, None)
'''


def demo_install_set() -> set[str]:
    """The distributions `pip install -e .[DEMO_EXTRAS]` brings: the base dependencies, the demo's
    extras (kv-offload[...] read from pyproject.toml) and, recursively, what each requires."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    todo += [Requirement(f"kv-offload[{extra}]") for extra in DEMO_EXTRAS]
    seen: set[str] = {"kv-offload"}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "kv-offload":
            for extra in req.extras:
                todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
            continue
        if name in seen:
            continue
        seen.add(name)
        for line in md.requires(req.name) or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(dep)
    return seen


def test_the_demo_installs_only_the_base_package_and_its_extra_not_ucx_nixl_helm_or_kubectl():
    assert DEMO_EXTRAS == {"demo"}
    installed = demo_install_set()
    assert "torch" in installed and not installed & NOT_FOR_THE_DEMO
    demo_venv = DEV.split("ensure_demo_venv() {", 1)[1].split("\n}\n", 1)[0]
    assert 'pip" install -q --disable-pip-version-check -e ".[$DEMO_EXTRAS]"' in demo_venv
    for step in ("ensure_helm", "ensure_nixl", "ensure_vllm_venv", "ensure_prometheus"):
        assert step not in demo_venv
    demo_case = DEV.split("\n  demo)\n", 1)[1].split(";;\n", 2)
    assert "ensure_demo_venv" in "".join(demo_case[:2])


def test_the_demo_runs_with_nothing_outside_its_install_set(tmp_path):
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    allowed = demo_install_set()
    blocked = {module for module, dists in md.packages_distributions().items()
               if not any(canonicalize_name(d) in allowed for d in dists)}
    assert {"ucxx", "nixl_cu12", "kopf", "kubernetes_asyncio", "transformers"} <= blocked
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "KV_OFFLOAD_TEST_BLOCKED": ",".join(sorted(blocked)),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "sidecar"), str(REPO / "operator")])}
    done = subprocess.run([sys.executable, "-m", "kv_offload_operator.cli", "demo", "--pods", "2",
                           "--requests", "6"], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mismatched bytes 0" in done.stdout and "of which peer hits" in done.stdout
