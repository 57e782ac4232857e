"""./dev's set-up: helm and kubectl at the pinned versions, from PATH when they are there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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
