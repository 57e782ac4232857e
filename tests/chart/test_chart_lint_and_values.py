"""The chart passes `helm lint --strict`, renders valid Kubernetes objects, and refuses bad values."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from chart_support import (
    CHART,
    FOREIGN_CRD_KINDS,
    NAMESPACE,
    RELEASE,
    kinds,
    load_documents,
    schema_errors,
)

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema on disk.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
EXAMPLES = sorted(p.name for p in (CHART / "examples").glob("*.yaml"))
ALL_FEATURES = "all-features.yaml"


def test_helm_lint_strict_passes_with_defaults_and_every_example(helm):
    for extra in [[]] + [["-f", str(CHART / "examples" / name)] for name in EXAMPLES]:
        result = helm("lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, f"helm lint --strict {extra}: {result.stdout}{result.stderr}"
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


# Every example against the newest schemas; defaults and all features also against the oldest.
VALIDATIONS = [(values, KUBERNETES_VERSIONS[-1]) for values in (None, *EXAMPLES)] + [
    (values, KUBERNETES_VERSIONS[0]) for values in (None, ALL_FEATURES)]


@pytest.mark.parametrize("values, kubernetes_version", VALIDATIONS,
                         ids=[f"{v or 'defaults'}-{k}" for v, k in VALIDATIONS])
def test_rendered_objects_validate_against_kubernetes_schemas(render, values, kubernetes_version):
    objects = render(*([values] if values else []))
    assert objects
    assert schema_errors(objects, kubernetes_version) == []


def test_all_features_example_turns_every_optional_object_on(render):
    rendered = set(kinds(render(ALL_FEATURES)))
    for kind in ("CustomResourceDefinition", "Deployment", "MutatingWebhookConfiguration",
                 "Certificate", "Issuer", "PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap",
                 "NetworkPolicy", "Role", "RoleBinding", "Pod", "PodDisruptionBudget"):
        assert kind in rendered, f"{kind} missing from the all-features render"
    # The only kinds left out of schema validation are the foreign CRDs, each with its reason.
    skipped = {(o["apiVersion"], o["kind"]) for o in render(ALL_FEATURES)} & FOREIGN_CRD_KINDS.keys()
    assert all(FOREIGN_CRD_KINDS[k] for k in skipped)


def test_schema_validation_catches_an_invalid_object():
    broken = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
              "spec": {"replicas": "one", "selector": {}, "template": {}}}
    errors = schema_errors([broken], KUBERNETES_VERSIONS[-1])
    assert len(errors) == 1 and "Deployment/x" in errors[0]


def test_rendered_yaml_has_no_duplicate_keys():
    with pytest.raises(Exception, match="duplicate key"):
        load_documents("a: 1\na: 2\n")


def test_values_schema_is_the_one_generated_from_values_yaml():
    proc = subprocess.run([sys.executable, str(CHART / "hack" / "gen-schema.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _objects_in(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if schema.get("type") == "object":
        found.append((path or "(top)", schema))
    for key, child in schema.get("properties", {}).items():
        found += _objects_in(child, f"{path}.{key}" if path else key)
    return found


def test_every_values_object_is_closed_or_declared_free_form_and_every_key_explained():
    schema = json.loads((CHART / "values.schema.json").read_text())
    objects = _objects_in(schema)
    assert len(objects) > 10
    free_form = {"operator.resources", "operator.affinity", "operator.podSecurityContext",
                 "operator.containerSecurityContext", "webhook.namespaceSelector"}
    for path, obj in objects:
        if path in free_form:
            assert obj.get("additionalProperties") is True, path
        elif obj.get("additionalProperties") is not False:
            # String maps (labels, annotations, nodeSelector) are open only to strings.
            assert obj["additionalProperties"] == {"type": "string"}, path
        if path != "(top)":
            assert len(obj["description"]) > 20, f"{path} is not explained in values.yaml"


@pytest.mark.parametrize("values, key", [
    ({"operator": {"watchNamespaces": "inference"}}, "watchNamespaces"),
    ({"webhook": {"certmanager": {"enabled": True}}}, "certmanager"),
    ({"imageTag": "0.2.0"}, "imageTag"),
    ({"monitoring": {"podMonitor": {"enable": True}}}, "enable"),
])
def test_misspelled_key_is_rejected_by_helm(render_error, values, key):
    error = render_error(values)
    assert "additional properties" in error and key in error


@pytest.mark.parametrize("values, words", [
    ({"webhook": {"failurePolicy": "Sometimes"}}, "failurePolicy"),
    ({"networkPolicy": {"pools": [{"name": "Llama_8B"}]}}, "name"),
    ({"networkPolicy": {"pools": [{"namespace": "inference"}]}}, "name"),
    ({"sidecar": {"controlPort": 70000}}, "controlPort"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"operator": {"replicas": 0}}, "replicas"),
    ({"operator": {"peering": {"lifetimeSeconds": 2}}}, "lifetimeSeconds"),
    ({"monitoring": {"prometheusRule": {"fetchTimeoutRatio": 2}}}, "fetchTimeoutRatio"),
])
def test_value_of_the_wrong_shape_is_rejected_by_helm(render_error, values, words):
    assert words in render_error(values)


@pytest.mark.parametrize("values, sentence", [
    ({"serviceAccount": {"create": False}},
     "serviceAccount.create is false but serviceAccount.name is empty"),
    ({"webhook": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}},
     "issuerRef.kind is ClusterIssuer but issuerRef.name is empty"),
    ({"networkPolicy": {"enabled": True, "monitoringNamespace": ""},
      "monitoring": {"podMonitor": {"enabled": True}}},
     "the NetworkPolicy would block Prometheus"),
    ({"sidecar": {"dataPort": 5712}}, "sidecar.dataPort 5712 lies in the control port range 5710-5717"),
    ({"sidecar": {"controlPort": 65530}}, "is above 65535"),
    ({"networkPolicy": {"enabled": True, "pools": [{"name": "llama"}], "servingPorts": [8000, 5810]}},
     "networkPolicy.servingPorts lists 5810, a sidecar port"),
    ({"networkPolicy": {"enabled": True}},
     "networkPolicy.enabled is true but networkPolicy.pools is empty"),
    ({"networkPolicy": {"enabled": True, "pools": [{"name": "llama", "namespace": NAMESPACE}, {"name": "llama"}]}},
     f"networkPolicy.pools lists pool {NAMESPACE}/llama twice"),
])
def test_invalid_combination_fails_with_a_sentence(render_error, values, sentence):
    error = render_error(values)
    assert sentence in error
    line = next(text for text in error.splitlines() if sentence in text)
    assert line.rstrip().endswith(".")


def test_packaged_chart_renders_the_same_objects(helm, render, tmp_path):
    packaged = helm("package", str(CHART), "--destination", str(tmp_path))
    assert packaged.returncode == 0, packaged.stderr
    (archive,) = tmp_path.glob("kv-offload-*.tgz")
    values = ["--set", "grafana.dashboards.enabled=true", "--set", "webhook.certManager.enabled=true"]
    result = helm("template", RELEASE, str(archive), "--namespace", NAMESPACE, *values)
    assert result.returncode == 0, result.stderr
    from_archive = load_documents(result.stdout)
    from_tree = render({"grafana": {"dashboards": {"enabled": True}},
                       "webhook": {"certManager": {"enabled": True}}})
    assert from_archive == from_tree
