"""The CRD, the operator Deployment and its RBAC, as the chart renders them."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import yaml
from chart_support import CHART, FULLNAME, NAMESPACE, REPO, WEBHOOK_DNS, find, kinds
from kv_offload_operator.rbac import operator_rbac
from kv_offload_operator.translation.translate import translate

POOL_CRD = "kvoffloadpools.kv-offload.io"


def test_crd_is_a_kept_template_behind_crds_enabled(render):
    crd = find(render(), "CustomResourceDefinition", POOL_CRD)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert POOL_CRD not in {o["metadata"]["name"] for o in render({"crds": {"enabled": False}})}
    unkept = find(render({"crds": {"keep": False}}), "CustomResourceDefinition", POOL_CRD)
    assert "helm.sh/resource-policy" not in unkept["metadata"].get("annotations", {})


def test_kopf_peering_crd_of_the_operators_scope_is_installed_kept_and_can_be_left_out(render):
    cluster = find(render(), "CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")
    assert (cluster["spec"]["scope"], cluster["spec"]["names"]["kind"]) == ("Cluster", "ClusterKopfPeering")
    assert cluster["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (version,) = cluster["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1", True, True)
    one_namespace = render({"operator": {"watchNamespace": "inference"}})
    namespaced = find(one_namespace, "CustomResourceDefinition", "kopfpeerings.kopf.dev")
    assert (namespaced["spec"]["scope"], namespaced["spec"]["names"]["kind"]) == ("Namespaced", "KopfPeering")
    assert "clusterkopfpeerings.kopf.dev" not in {o["metadata"]["name"] for o in one_namespace}
    without = render({"crds": {"kopfPeering": False}})
    assert [o["metadata"]["name"] for o in without if o["kind"] == "CustomResourceDefinition"] == [POOL_CRD]


def test_operator_runs_non_root_read_only_with_resources_and_health_probes(render):
    deployment = find(render(), "Deployment", FULLNAME)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"webhook": 9443, "health": 8080, "metrics": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_the_webhook_is_served_by_two_replicas_kept_up_through_rollouts_drains_and_node_loss(render):
    objects = render()
    deployment = find(objects, "Deployment", FULLNAME)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] == 2
    # A new replica serves before an old one stops.
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    budget = find(objects, "PodDisruptionBudget", FULLNAME)
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    pod = deployment["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": selector}
    (spread,) = pod["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == ("topology.kubernetes.io/zone", "ScheduleAnyway")
    assert spread["labelSelector"] == {"matchLabels": selector}
    # Each replica knows its own name among its peers (kopf's POD_ID), and they share one peering object.
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert f"--peering={FULLNAME}" in container["args"] and "--peering-lifetime-seconds=30" in container["args"]
    # One replica: no budget (it could never be met), a warning in NOTES; user affinity replaces the default.
    single = render({"operator": {"replicas": 1, "affinity": {"nodeAffinity": {}},
                                  "topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "rack",
                                                                 "whenUnsatisfiable": "DoNotSchedule"}]}})
    assert "PodDisruptionBudget" not in kinds(single)
    single_pod = find(single, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert single_pod["affinity"] == {"nodeAffinity": {}}
    assert [c["topologyKey"] for c in single_pod["topologySpreadConstraints"]] == ["rack"]
    assert "PodDisruptionBudget" not in kinds(render({"operator": {"podDisruptionBudget": {"enabled": False}}}))


def test_operator_command_line_matches_the_values(render):
    deployment = find(render({"operator": {"watchNamespace": "inference"},
                              "image": {"repository": "reg.example/kvo", "tag": "9.9"}}), "Deployment", FULLNAME)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "reg.example/kvo:9.9"
    assert container["args"] == [
        "operator", "--namespace=inference", "--webhook-port=9443",
        "--webhook-cert-dir=/etc/kv-offload/webhook-tls", f"--webhook-host={WEBHOOK_DNS}",
        "--health-port=8080", "--metrics-port=8081", "--ready-peers-check-seconds=15",
        f"--peering={FULLNAME}",
        "--peering-lifetime-seconds=30", "--sidecar-image=reg.example/kvo:9.9",
        "--sidecar-base-port=5710", "--sidecar-data-port=5810",
        "--sidecar-prefill-tokens-per-second=0", "--sidecar-peer-copies=drop",
        "--sidecar-transport=", "--sidecar-lanes=0",
    ]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/kv-offload/webhook-tls"] == "webhook-tls" and mounts["/tmp"] == "tmp"
    everywhere = find(render(), "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in everywhere


def _granted(objects: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str]]:
    """What the operator's own Role or ClusterRole (not the certificate Jobs') grants."""
    return {(group, resource, verb)
            for role in objects if role["kind"] == kind and role["metadata"]["name"] == FULLNAME
            for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}


def operator_grants(clusterwide: bool) -> set[tuple[str, str, str]]:
    """What the operator uses (its own declaration, which the operator tests hold its
    API requests to), and nothing more."""
    return {(group, resource, verb)
            for (group, resource), verbs in operator_rbac(clusterwide).items() for verb in verbs}


def test_rbac_grants_exactly_what_the_operator_uses_cluster_wide(render):
    objects = render()
    assert _granted(objects, "ClusterRole") == operator_grants(clusterwide=True)
    assert FULLNAME not in {o["metadata"]["name"] for o in objects if o["kind"] == "Role"}
    account = find(objects, "ServiceAccount", FULLNAME)["metadata"]["name"]
    binding = find(objects, "ClusterRoleBinding", FULLNAME)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    find(objects, "ClusterRole", binding["roleRef"]["name"])
    assert find(objects, "Deployment", FULLNAME)["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_rbac_and_webhook_are_confined_to_the_watched_namespace_when_one_is_set(render):
    objects = render({"operator": {"watchNamespace": "inference"}})
    assert _granted(objects, "Role") == operator_grants(clusterwide=False)
    cluster_wide = ("ClusterRole", "ClusterRoleBinding")
    assert FULLNAME not in {o["metadata"]["name"] for o in objects if o["kind"] in cluster_wide}
    assert find(objects, "Role", FULLNAME)["metadata"]["namespace"] == "inference"
    binding = find(objects, "RoleBinding", FULLNAME)
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["inference"]}]}
    (everywhere,) = find(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert "namespaceSelector" not in everywhere


def test_existing_service_account_is_used_and_not_created(render):
    objects = render({"serviceAccount": {"create": False, "name": "platform-operator"}})
    # Only the certificate Jobs' own account is created.
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"] == [f"{FULLNAME}-webhook-cert"]
    assert find(objects, "Deployment", FULLNAME)["spec"]["template"]["spec"]["serviceAccountName"] == \
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
    from kv_offload_operator.pools import kv_transfer
    argv = kv_transfer.effective_argv(pool["spec"]["vllmArgs"], kv_transfer.injected_connector(pool["spec"]),
                                      "spec.vllmArgs")
    config = translate(argv, model_config)
    assert config.model.name == "meta-llama/Llama-3.1-8B-Instruct" and len(config.fingerprint) == 16
