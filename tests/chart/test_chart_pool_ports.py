"""Per-pool ports in the NetworkPolicy, and the RDMA and targetRef example manifests: valid for
Kubernetes, the CRD and the operator, and their pods what the webhook would make of them."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_support import CHART, REPO, find, load_documents
from kv_offload_operator.pools import pool_source, pool_spec
from kv_offload_operator.webhook import pod_patch
from kv_offload_operator.pools.kv_transfer import effective_argv, injected_connector
from kv_offload_operator.translation.translate import pool_config

MANIFESTS = CHART / "examples" / "manifests"
K8S = "1.33.0"
MODEL = json.loads((REPO / "tests" / "operator" / "fixtures" / "llama-3.1-8b.json").read_text())


def manifest(name: str) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in load_documents((MANIFESTS / name).read_text())}


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def template_pod(deployment: dict[str, Any]) -> dict[str, Any]:
    template = deployment["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": dict(template["metadata"], name="p", namespace=deployment["metadata"]["namespace"]),
            "spec": copy.deepcopy(template["spec"])}


def injected(pool: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    sidecar = pool_spec.SidecarSpec.from_pool(pool, default_image="kv-offload:test")
    ops = pod_patch.pod_patch(pod, pool, fingerprint="f" * 16, sidecar=sidecar)
    out = jsonpatch.JsonPatch(ops).apply(copy.deepcopy(pod))
    kubernetes_validate.validate(out, K8S, strict=True)
    return out


def admitted_ports(policy: dict[str, Any]) -> set[int]:
    ports: set[int] = set()
    for port in policy["spec"]["ingress"][0]["ports"]:
        ports |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    return ports


def test_a_pools_own_ports_in_its_network_policy_entry_admit_what_its_sidecar_listens_on(render):
    docs = manifest("pool-rdma.yaml")
    sidecar = injected(docs["KVOffloadPool"], template_pod(docs["Deployment"]))["spec"]["initContainers"][1]
    wanted = {p["containerPort"] for p in sidecar["ports"]}
    assert wanted == {6710, 6810}
    values = {"networkPolicy": {"enabled": True, "openAllPortsBetweenPoolPods": False, "pools": [
        {"name": "llama-rdma", "namespace": "inference", "basePort": 6710, "dataPort": 6810, "controlPortCount": 2},
        {"name": "llama-8b", "namespace": "inference"}]}}
    objects = render(values)
    own = find(objects, "NetworkPolicy", "kvo-kv-offload-pool-llama-rdma")
    assert wanted <= admitted_ports(own) == {6710, 6711, 6810}
    defaults = find(objects, "NetworkPolicy", "kvo-kv-offload-pool-llama-8b")
    assert not wanted & admitted_ports(defaults)  # an entry without ports opens the sidecar.* defaults
    assert admitted_ports(defaults) == set(range(5710, 5718)) | {5810}


@pytest.mark.parametrize("entry, sentence", [
    ({"basePort": 6710, "dataPort": 6712},
     "networkPolicy.pools entry inference/a: dataPort 6712 lies in its control port range 6710-6717"),
    ({"basePort": 7990, "dataPort": 9000},
     "networkPolicy.servingPorts lists 7995, a sidecar port of pool inference/a"),
])
def test_per_pool_ports_that_cannot_work_fail_with_a_sentence(render_error, entry, sentence):
    values = {"networkPolicy": {"enabled": True, "servingPorts": [7995],
                                "pools": [dict(entry, name="a", namespace="inference")]}}
    assert sentence in render_error(values)


def test_the_rdma_example_is_valid_and_its_pod_gets_rdma_host_ports_and_the_memory_for_its_store():
    docs = manifest("pool-rdma.yaml")
    pool, deployment = docs["KVOffloadPool"], docs["Deployment"]
    jsonschema.validate(pool, crd_schema())
    kubernetes_validate.validate(deployment, K8S, strict=True)
    assert len(pool_config(pool["spec"]["vllmArgs"], MODEL).fingerprint) == 16
    pod = injected(pool, template_pod(deployment))
    sidecar = pod["spec"]["initContainers"][1]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["UCX_TLS"] == "rc,sm,self,tcp"
    assert sidecar["resources"]["limits"] == {"rdma/ib": "1"}
    assert sidecar["resources"]["requests"]["memory"] == "16640Mi"
    assert all(p["hostPort"] == p["containerPort"] for p in sidecar["ports"])
    # The pod's own vLLM container translates to the pool's fingerprint (the webhook admits it).
    assert pod_patch.pod_identity_problem(template_pod(deployment), pool_config(pool["spec"]["vllmArgs"], MODEL),
                                          MODEL) is None


def test_the_target_ref_example_translates_the_deployments_container_with_the_injected_connector():
    docs = manifest("pool-targetref.yaml")
    pool, deployment = docs["KVOffloadPool"], docs["Deployment"]
    jsonschema.validate(pool, crd_schema())
    kubernetes_validate.validate(deployment, K8S, strict=True)
    assert "vllmArgs" not in pool["spec"]
    read = pool_source.template_source("Deployment", deployment["metadata"]["name"], deployment)
    connector = injected_connector(pool["spec"])
    assert connector is not None and connector.cpu_bytes_to_use == 8 << 30
    config = pool_config(effective_argv(read.argv, connector, read.where), MODEL, env=read.env)
    assert config.extra_config["spec_name"] == "TieringOffloadingSpec"
    pod = injected(pool, template_pod(deployment))
    vllm = pod["spec"]["containers"][0]
    assert vllm["args"][-2:] == ["--kv-transfer-config", connector.text()]
    assert pod_patch.pod_identity_problem(pod, config, MODEL) is None


def test_the_crd_refuses_a_pool_with_both_or_neither_of_vllm_args_and_target_ref():
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    rules = [r["rule"] for r in crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
             ["x-kubernetes-validations"]]
    assert "has(self.vllmArgs) != has(self.targetRef)" in rules
    schema = crd_schema()
    pool = manifest("pool-targetref.yaml")["KVOffloadPool"]
    for bad in ({"kind": "DaemonSet"}, {"apiVersion": "apps/v2"}, {"name": ""}):
        broken = copy.deepcopy(pool)
        broken["spec"]["targetRef"].update(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
