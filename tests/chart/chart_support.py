"""Helpers shared by the chart tests: paths, tool lookup, strict YAML, rendered-object queries."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kv-offload"
RELEASE = "kvo"
NAMESPACE = "kv-offload-system"
# Every object the chart renders is prefixed with this ("<release>-<chart>").
FULLNAME = f"{RELEASE}-kv-offload"
# The webhook Service's DNS name, which the serving certificate must carry.
WEBHOOK_DNS = f"{FULLNAME}.{NAMESPACE}.svc"


def tool_path(name: str) -> str:
    """A binary from the venv's bin directory, else from PATH; fails the test when absent."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed: run `./dev setup`, which installs it")
    return found


class UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate mapping keys (which the API server would reject)."""


def _construct_unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode,
                              deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                _construct_unique_mapping)


def load_documents(text: str) -> list[dict[str, Any]]:
    """The non-empty YAML documents of a multi-document stream."""
    return [doc for doc in yaml.load_all(text, Loader=UniqueKeyLoader) if doc]


class HelmResult:
    """One `helm` run: exit code, stdout, stderr."""

    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one rendered object of ``kind`` (and ``name``); fails when absent or ambiguous."""
    matches = [o for o in objects
               if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, (f"expected one {kind} {name or ''}, rendered: "
                               f"{[(o['kind'], o['metadata']['name']) for o in objects]}")
    return matches[0]


def webhook_cert_job_argv(objects: list[dict[str, Any]], step: str) -> list[str]:
    """The command line of the rendered certificate Job ``step`` (create or patch), runnable here."""
    job = find(objects, "Job", f"{FULLNAME}-webhook-cert-{step}")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return [str(Path(sys.executable).with_name("kv-offload")), *container["args"]]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    """The kinds of the rendered objects, in order."""
    return [o["kind"] for o in objects]


# Kinds served by CRDs of other projects, which kubernetes-validate has no schema
# for. Each is checked by the chart tests' own assertions instead; the reason
# says why it is not schema-validated here.
FOREIGN_CRD_KINDS: dict[tuple[str, str], str] = {
    ("monitoring.coreos.com/v1", "PodMonitor"):
        "Prometheus Operator CRD; its schema is not shipped with kubernetes-validate",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        "Prometheus Operator CRD; its schema is not shipped with kubernetes-validate",
    ("monitoring.coreos.com/v1", "PrometheusRule"):
        "Prometheus Operator CRD; its rules are checked and evaluated by promtool (test_prometheus_rules.py)",
    ("cert-manager.io/v1", "Certificate"):
        "cert-manager CRD; its schema is not shipped with kubernetes-validate",
    ("cert-manager.io/v1", "Issuer"):
        "cert-manager CRD; its schema is not shipped with kubernetes-validate",
}


def schema_errors(objects: list[dict[str, Any]], kubernetes_version: str) -> list[str]:
    """kubernetes-validate (strict: unknown fields are errors) over every object.

    Returns one line per invalid object; objects of FOREIGN_CRD_KINDS are left out.
    """
    import kubernetes_validate

    errors = []
    for obj in objects:
        if (obj.get("apiVersion"), obj.get("kind")) in FOREIGN_CRD_KINDS:
            continue
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(part) for part in exc.absolute_path)
            errors.append(f"{name}: {exc.message} at /{path}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{name}: no Kubernetes {kubernetes_version} schema for "
                          f"{obj.get('apiVersion')} {obj.get('kind')}")
    return errors
