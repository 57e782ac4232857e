"""pyproject.toml's requirements carry what the code imports: a floor is no lower than the first
release with every module we import from that distribution."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.version import Version
from test_package_layout import REPO, imports

# Modules that a distribution gained in a later release: (distribution, module) -> that release.
ADDED_IN = {
    ("prometheus-client", "prometheus_client.aiohttp"): Version("0.22"),
}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def floor(distribution: str) -> Version:
    """The lowest version the base requirements allow for ``distribution``."""
    for line in pyproject()["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == distribution:
            lows = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
            assert lows, f"{line!r} sets no floor"
            return max(lows)
    raise AssertionError(f"{distribution} is not a base requirement")


def imported_modules() -> set[str]:
    return {name for root in ("sidecar", "operator") for path in (REPO / root).rglob("*.py")
            for name, _ in imports(path)}


def test_each_floor_has_every_module_the_code_imports_from_it():
    used = imported_modules()
    for (distribution, module), added in ADDED_IN.items():
        if module in used:
            assert floor(distribution) >= added, (
                f"{module} is imported but pyproject.toml allows {distribution} {floor(distribution)}; "
                f"it exists from {added}")


def test_the_base_install_brings_no_data_plane_library_operator_runtime_or_tool():
    base = {Requirement(line).name for line in pyproject()["project"]["dependencies"]}
    assert not base & {"ucxx-cu12", "nixl-cu12", "kopf", "kubernetes-asyncio", "torch"}
    extras = pyproject()["project"]["optional-dependencies"]
    named = {extra: {Requirement(line).name for line in lines} for extra, lines in extras.items()}
    assert named["ucx"] == {"ucxx-cu12"} and named["nixl"] == {"nixl-cu12"}
    assert named["operator"] == {"kopf", "kubernetes-asyncio"}


def test_the_dev_venv_installs_every_extra_it_tests():
    dev = (REPO / "dev").read_text()
    assert '-e ".[tools,test,ucx,operator]"' in dev
    test = {Requirement(line) for line in pyproject()["project"]["optional-dependencies"]["test"]}
    assert any(r.name == "kv-offload" and {"tools", "ucx", "operator"} <= r.extras for r in test)
