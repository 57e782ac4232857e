"""`kv-offload install-tier`: the tier and its contract land in the volume, importable from it alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kv_offload_sidecar.commands.install_tier import install, tier_files


def test_the_engine_subpackages_are_shipped_with_the_tier():
    shipped = {p.as_posix() for p in tier_files()}
    assert {"__init__.py", "engine/__init__.py", "engine/vllm_tier.py",
            "engine/contract/__init__.py", "engine/contract/offloading_config.py"} <= shipped
    assert not any("__pycache__" in p for p in shipped)


def test_an_installed_tier_imports_its_contract_from_the_volume(tmp_path):
    target = install(tmp_path)
    assert (target / "engine" / "contract" / "ports.py").is_file()
    code = ("import json, kv_offload_sidecar.engine.vllm_tier as t, kv_offload_sidecar.engine.contract.ports as p; "
            "print(json.dumps([t.__file__, p.__file__]))")
    # Only the volume on the path, as in the vLLM container (numpy comes from the interpreter's site).
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    files = json.loads(out.stdout)
    assert all(Path(f).is_relative_to(target) for f in files), files
