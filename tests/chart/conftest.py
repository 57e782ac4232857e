"""Fixtures for the chart tests: the real `helm` binary and its rendered output.

`helm` is the binary `./dev` unpacks into .venv/bin (or the one on PATH).
Rendering goes through `helm template`, so values are checked against the
chart's values.schema.json exactly as at install time.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import yaml
from chart_support import (
    CHART,
    NAMESPACE,
    RELEASE,
    REPO,
    HelmResult,
    load_documents,
    tool_path,
)


@pytest.fixture(scope="session")
def helm() -> Callable[..., HelmResult]:
    """Run the real helm binary with arguments; returns its result (never raises on exit code)."""
    binary = tool_path("helm")

    def run(*args: str, timeout: float = 60) -> HelmResult:
        proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)
        return HelmResult(proc)

    return run


@pytest.fixture(scope="session")
def render(helm: Callable[..., HelmResult], tmp_path_factory: pytest.TempPathFactory
           ) -> Callable[..., list[dict[str, Any]]]:
    """`helm template` the chart with values (dicts and/or example file names); returns the objects.

    Fails the test with helm's message when rendering fails. Each distinct set of
    values is rendered once per session (the same self-managed certificate then
    appears in every test that renders the defaults).
    """
    tmp = tmp_path_factory.mktemp("values")
    counter = [0]
    cache: dict[str, str] = {}

    def _render(*values: dict[str, Any] | str, show_only: Sequence[str] = ()) -> list[dict[str, Any]]:
        key = json.dumps([values, list(show_only)], sort_keys=True)
        if key not in cache:
            cache[key] = _template(values, show_only)
        return load_documents(cache[key])  # fresh objects: tests may not alter each other's

    def _template(values: tuple[dict[str, Any] | str, ...], show_only: Sequence[str]) -> str:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for item in values:
            if isinstance(item, str):
                args += ["-f", str(CHART / "examples" / item)]
            else:
                counter[0] += 1
                path = tmp / f"values-{counter[0]}.yaml"
                path.write_text(yaml.safe_dump(item))
                args += ["-f", str(path)]
        for template in show_only:
            args += ["--show-only", template]
        result = helm(*args)
        if result.returncode != 0:
            pytest.fail(f"helm template failed: {result.stderr.strip()}")
        return result.stdout

    return _render


@pytest.fixture(scope="session")
def render_error(helm: Callable[..., HelmResult], tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[dict[str, Any]], str]:
    """`helm template` with values that must be refused; returns helm's error text."""
    tmp = tmp_path_factory.mktemp("bad-values")
    counter = [0]

    def _render_error(values: dict[str, Any]) -> str:
        counter[0] += 1
        path = tmp / f"bad-{counter[0]}.yaml"
        path.write_text(yaml.safe_dump(values))
        result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(path))
        assert result.returncode != 0, f"helm accepted values it should refuse: {values}"
        return result.stderr

    return _render_error


