"""The CRD, the operator Deployment and its RBAC, as the chart renders them."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import yaml
from chart_support import CHART, NAMESPACE, REPO, WEBHOOK_DNS, find, kinds
from kv_offload_operator.rbac import OPERATOR_RBAC
from kv_offload_operator.translation.translate import translate


def test_crd_is_a_kept_template_behind_crds_enabled(render):
    crd = find(render(), "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "kvoffloadpools.kv-offload.io"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "CustomResourceDefinition" not in kinds(render({"crds": {"enabled": False}}))
    unkept = find(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in unkept["metadata"].get("annotations", {})


def test_operator_runs_non_root_read_only_with_resources_and_health_probes(render):
    deployment = find(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"webhook": 9443, "health": 8080}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert deployment["spec"]["replicas"] == 1


def test_operator_command_line_matches_the_values(render):
    deployment = find(render({"operator": {"watchNamespace": "inference"},
                              "image": {"repository": "reg.example/kvo", "tag": "9.9"}}), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "reg.example/kvo:9.9"
    assert container["args"] == [
        "operator", "--namespace=inference", "--webhook-port=9443",
        "--webhook-cert-dir=/etc/kv-offload/webhook-tls", f"--webhook-host={WEBHOOK_DNS}",
        "--health-port=8080", "--sidecar-image=reg.example/kvo:9.9",
    ]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/kv-offload/webhook-tls"] == "webhook-tls" and mounts["/tmp"] == "tmp"
    everywhere = find(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in everywhere


def _granted(objects: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str]]:
    return {(group, resource, verb)
            for role in objects if role["kind"] == kind
            for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}


# What the operator uses (its own declaration, which the operator tests hold its
# API requests to), and nothing more.
OPERATOR_GRANTS = {(group, resource, verb)
                   for (group, resource), verbs in OPERATOR_RBAC.items() for verb in verbs}


def test_rbac_grants_exactly_what_the_operator_uses_cluster_wide(render):
    objects = render()
    assert _granted(objects, "ClusterRole") == OPERATOR_GRANTS
    assert "Role" not in kinds(objects)
    account = find(objects, "ServiceAccount")["metadata"]["name"]
    binding = find(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    find(objects, "ClusterRole", binding["roleRef"]["name"])
    assert find(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_rbac_and_webhook_are_confined_to_the_watched_namespace_when_one_is_set(render):
    objects = render({"operator": {"watchNamespace": "inference"}})
    assert _granted(objects, "Role") == OPERATOR_GRANTS
    assert "ClusterRole" not in kinds(objects) and "ClusterRoleBinding" not in kinds(objects)
    assert find(objects, "Role")["metadata"]["namespace"] == "inference"
    binding = find(objects, "RoleBinding")
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["inference"]}]}
    (everywhere,) = find(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert "namespaceSelector" not in everywhere


def test_existing_service_account_is_used_and_not_created(render):
    objects = render({"serviceAccount": {"create": False, "name": "platform-operator"}})
    assert "ServiceAccount" not in kinds(objects)
    assert find(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == \
        "platform-operator"


def test_readme_pool_example_is_valid_against_the_chart_crd():
    readme = (CHART / "README.md").read_text()
    (block,) = re.findall(r"apply -f - <<'EOF'\n(.*?)\nEOF\n", readme, re.S)
    pool = yaml.safe_load(block)
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    assert pool["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    assert pool["kind"] == crd["spec"]["names"]["kind"]
    schema = version["schema"]["openAPIV3Schema"]
    jsonschema.validate(pool, schema)
    declared = schema["properties"]["spec"]["properties"]
    assert set(pool["spec"]) <= set(declared)
    assert set(pool["spec"]["sidecar"]) <= set(declared["sidecar"]["properties"])
    # The operator translates the example (with a Llama-3.1-8B config.json from its test fixtures).
    model_config = json.loads((REPO / "tests" / "operator" / "fixtures" / "llama-3.1-8b.json").read_text())
    config = translate(pool["spec"]["vllmArgs"], model_config)
    assert config.model.name == "meta-llama/Llama-3.1-8B-Instruct" and len(config.fingerprint) == 16
