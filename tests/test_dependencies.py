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
