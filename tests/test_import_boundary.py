"""Import boundaries: the sidecar never loads the operator, kopf or vLLM; the operator package stays light."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from dataclasses import dataclass

import kv_offload_sidecar

FORBIDDEN_FOR_SIDECAR = ("kv_offload_operator", "kopf", "vllm")


@dataclass(frozen=True)
class ImportResult:
    # Every module loaded once the imports ran.
    loaded: frozenset[str]
    # Modules loaded by the imports (site hooks and .pth files excluded).
    new: frozenset[str]
    # Module -> repr of the exception it raised on import.
    failed: dict[str, str]


def sidecar_modules() -> list[str]:
    """Every sidecar submodule that exists on disk (the set grows as modules land)."""
    return sorted(
        m.name
        for m in pkgutil.walk_packages(kv_offload_sidecar.__path__, prefix="kv_offload_sidecar.")
        if not m.name.rsplit(".", 1)[-1].startswith("_")
    )


def import_in_fresh_interpreter(modules: list[str]) -> ImportResult:
    code = (
        "import importlib, json, sys\n"
        "before = sorted(sys.modules)\n"
        "failed = {}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed[name] = repr(exc)\n"
        "print(json.dumps({'after': sorted(sys.modules), 'before': before, 'failed': failed}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    after = frozenset(result["after"])
    return ImportResult(after, after - frozenset(result["before"]), result["failed"])


def offenders(loaded: frozenset[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if m.split(".")[0] in roots)


def test_importing_the_sidecar_package_loads_no_operator_kopf_or_vllm():
    result = import_in_fresh_interpreter(["kv_offload_sidecar"])
    assert not result.failed
    assert offenders(result.loaded, FORBIDDEN_FOR_SIDECAR) == []


def test_every_sidecar_module_imports_without_operator_kopf_or_vllm():
    modules = sidecar_modules()
    assert "kv_offload_sidecar.engine.contract.offloading_config" in modules
    result = import_in_fresh_interpreter(modules)
    # A module failing to import for its own reasons is its owner's test to catch;
    # here only what got loaded matters.
    assert offenders(result.loaded, FORBIDDEN_FOR_SIDECAR) == []


def test_config_boundary_modules_are_standard_library_only():
    result = import_in_fresh_interpreter(
        ["kv_offload_sidecar.engine.contract.offloading_config", "kv_offload_operator.translation.vllm_args",
         "kv_offload_operator.translation.translate"])
    assert not result.failed
    third_party = sorted({m.split(".")[0] for m in result.new}
                         - set(sys.stdlib_module_names) - {"kv_offload_sidecar", "kv_offload_operator"})
    assert third_party == []


def test_importing_the_operator_translation_does_not_load_kopf():
    result = import_in_fresh_interpreter(
        ["kv_offload_operator", "kv_offload_operator.translation.translate", "kv_offload_operator.cli"])
    assert not result.failed
    assert offenders(result.loaded, ("kopf", "vllm")) == []
