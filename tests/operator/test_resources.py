"""The pure builders of resources.py, and the CRD file, without a cluster."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kv_offload_operator import resources as r
from kv_offload_operator.translate import translate
from kv_offload_sidecar.offloading_config import OffloadingConfig
from operator_harness import KTC, LLAMA_ARGS, llama_config, pool_body

CRD_PATH = Path(__file__).parents[2] / "charts" / "kv-offload" / "files" / "crd-kvoffloadpools.yaml"
K8S = "1.33.0"


@pytest.fixture(scope="module")
def config() -> OffloadingConfig:
    return translate(LLAMA_ARGS, llama_config())


def pool(**sidecar: Any) -> dict[str, Any]:
    return pool_body("llama", sidecar=sidecar or None)


def sidecar_spec(**kw: Any) -> r.SidecarSpec:
    return r.SidecarSpec.from_pool(pool(**kw), default_image="img:1")


def pod(*containers: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns1", "labels": {r.POOL_LABEL: "llama"}, **meta},
            "spec": {"containers": list(containers)}}


def vllm(args: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "command": ["vllm"],
            "args": args if args is not None else ["serve", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", KTC],
            **extra}


def inject(p: dict[str, Any], **kw: Any) -> dict[str, Any]:
    ops = r.pod_patch(p, pool(), fingerprint="abcd" * 4, sidecar=sidecar_spec(**kw))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(p))


# ---- pool children ------------------------------------------------------------

def test_configmap_holds_the_config_json_that_loads_back_equal_and_is_owned_by_the_pool(config: OffloadingConfig) -> None:
    cm = r.configmap_for(pool(), config)
    assert cm["metadata"]["name"] == "llama-offloading-config"
    assert OffloadingConfig.from_json(cm["data"]["offloading_config.json"]) == config
    assert cm["metadata"]["ownerReferences"] == [{
        "apiVersion": "kv-offload.io/v1alpha1", "kind": "KVOffloadPool", "name": "llama",
        "uid": "uid-llama", "controller": True, "blockOwnerDeletion": True}]
    kubernetes_validate.validate(cm, K8S, strict=True)


def test_pool_key_secret_carries_the_given_key_and_refuses_short_keys() -> None:
    secret = r.pool_key_secret(pool(), b"k" * 32)
    assert secret["metadata"]["name"] == "llama-pool-key"
    assert base64.b64decode(secret["data"]["key"]) == b"k" * 32
    kubernetes_validate.validate(secret, K8S, strict=True)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        r.pool_key_secret(pool(), b"short")


def test_peers_service_is_headless_and_lists_one_control_port_per_dp_rank_plus_data() -> None:
    dp4 = translate(["vllm", "serve", "m", "-dp", "4", "--kv-transfer-config", KTC], llama_config())
    ports = r.pool_ports(dp4, sidecar_spec(basePort=6000))
    assert ports == {"kvo-ctrl-0": 6000, "kvo-ctrl-1": 6001, "kvo-ctrl-2": 6002, "kvo-ctrl-3": 6003,
                     "kvo-data": 5810}
    svc = r.peers_service(pool(), ports)
    assert svc["metadata"]["name"] == "llama-peers"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"kv-offload.io/pool": "llama"}
    kubernetes_validate.validate(svc, K8S, strict=True)


def test_sidecar_spec_defaults_and_rejects_bad_values_naming_the_field() -> None:
    s = r.SidecarSpec.from_pool(pool(), default_image="img:1")
    assert (s.image, s.capacity_bytes, s.transport, s.base_port, s.data_port) == \
        ("img:1", 4 << 30, "ucx", 5710, 5810)
    assert s.shm_size_limit == (4 << 30) + (1 << 30)
    with pytest.raises(ValueError, match=r"spec\.sidecar\.transport='rdma'"):
        sidecar_spec(transport="rdma")
    with pytest.raises(ValueError, match=r"spec\.sidecar\.capacityBytes=0"):
        sidecar_spec(capacityBytes=0)
    with pytest.raises(ValueError, match=r"spec\.sidecar\.image"):
        r.SidecarSpec.from_pool(pool(), default_image="")


def test_conditions_keep_their_transition_time_until_the_status_flips() -> None:
    first = r.pool_conditions(None, invalid_message=None, generation=1, now="t1")
    assert {c["type"]: c["status"] for c in first} == {"Ready": "True", "Invalid": "False"}
    same = r.pool_conditions(first, invalid_message=None, generation=2, now="t2")
    assert [c["lastTransitionTime"] for c in same] == ["t1", "t1"]
    flipped = r.pool_conditions(same, invalid_message="fix --block-size", generation=3, now="t3")
    invalid = next(c for c in flipped if c["type"] == "Invalid")
    assert (invalid["status"], invalid["message"], invalid["lastTransitionTime"]) == ("True", "fix --block-size", "t3")
    assert r.invalid_message({"status": {"conditions": flipped}}) == "fix --block-size"
    assert r.invalid_message({"status": {"conditions": first}}) is None


# ---- pod injection --------------------------------------------------------------

def test_injection_is_idempotent_and_marks_the_pod_with_the_fingerprint() -> None:
    once = inject(pod(vllm()))
    assert once["metadata"]["annotations"][r.INJECTED_ANNOTATION] == "abcd" * 4
    assert r.pod_patch(once, pool(), fingerprint="ffff" * 4, sidecar=sidecar_spec()) == []
    kubernetes_validate.validate(once, K8S, strict=True)


def test_user_init_containers_env_and_pythonpath_are_kept() -> None:
    user_init = {"name": "fetch-weights", "image": "busybox", "command": ["true"]}
    p = pod(vllm(env=[{"name": "PYTHONPATH", "value": "/opt/extra"},
                      {"name": "VLLM_P2P_SIDE_CHANNEL_PORT", "value": "1"}]))
    p["spec"]["initContainers"] = [user_init]
    out = inject(p)
    assert [c["name"] for c in out["spec"]["initContainers"]] == \
        ["fetch-weights", r.TIER_INIT_NAME, r.SIDECAR_NAME]
    env = {e["name"]: e.get("value") for e in out["spec"]["containers"][0]["env"]}
    assert env["PYTHONPATH"] == "/kv-offload-lib:/opt/extra"
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"] == "5710"  # ours wins over a stale value
    names = [e["name"] for e in out["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names))


def test_pythonpath_from_value_from_is_refused_with_what_to_change() -> None:
    p = pod(vllm(env=[{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}]))
    with pytest.raises(ValueError, match="PYTHONPATH with valueFrom"):
        inject(p)


def test_the_vllm_container_is_found_among_others_or_named_by_annotation() -> None:
    proxy = {"name": "proxy", "image": "envoy", "args": ["--config", "/etc/envoy.yaml"]}
    api_server = {"name": "engine", "image": "vllm/vllm-openai:v0.11.0",
                  "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                  "args": ["--model", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", KTC]}
    out = inject(pod(proxy, api_server))
    assert "env" not in out["spec"]["containers"][0]
    assert {e["name"] for e in out["spec"]["containers"][1]["env"]} >= {"VLLM_P2P_SIDE_CHANNEL_HOST", "PYTHONPATH"}

    two = pod(vllm(), dict(vllm(), name="vllm-2"))
    with pytest.raises(ValueError, match=r"set annotation kv-offload.io/vllm-container"):
        inject(two)
    named = inject(dict(two, metadata=dict(two["metadata"], annotations={r.VLLM_CONTAINER_ANNOTATION: "vllm-2"})))
    assert "env" not in named["spec"]["containers"][0] and "env" in named["spec"]["containers"][1]


def test_dp_ranks_come_from_the_pods_own_args() -> None:
    args = ["serve", "m", "--data-parallel-size", "8", "--data-parallel-rank", "5", "--kv-transfer-config", KTC]
    out = inject(pod(vllm(args)), basePort=7000)
    sidecar = out["spec"]["initContainers"][1]
    assert [p["containerPort"] for p in sidecar["ports"]] == [7005, 5810]
    assert sidecar["readinessProbe"]["httpGet"]["port"] == 7005
    env = {e["name"]: e.get("value") for e in out["spec"]["containers"][0]["env"]}
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"] == "7000"  # base; the tier adds its DP index


def test_unparsable_vllm_args_are_refused_naming_the_container() -> None:
    with pytest.raises(ValueError, match=r"container 'vllm'.*--data-parallel-size"):
        inject(pod(vllm(["serve", "m", "--data-parallel-size", "many"])))


def test_apply_patch_agrees_with_an_independent_rfc6902_implementation() -> None:
    p = pod(vllm(volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}]))
    p["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    ops = r.pod_patch(p, pool(), fingerprint="f" * 16, sidecar=sidecar_spec())
    ours = copy.deepcopy(p)
    r.apply_patch(ours, ops)
    assert ours == jsonpatch.JsonPatch(ops).apply(copy.deepcopy(p))


# ---- the CRD ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def test_crd_is_a_valid_v1alpha1_namespaced_crd_with_status_and_printer_columns(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, K8S, strict=True)
    assert crd["metadata"]["name"] == "kvoffloadpools.kv-offload.io"
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["jsonPath"] for c in version["additionalPrinterColumns"]] == \
        [".status.fingerprint", ".status.readyPeers", ".metadata.creationTimestamp"]


def test_crd_schema_accepts_a_real_pool_and_rejects_a_bad_transport(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    good = pool_body("llama", sidecar={"transport": "tcp", "basePort": 5710, "capacityBytes": 1 << 30,
                                       "resources": {"limits": {"memory": "2Gi"}}})
    good["spec"]["shmSizeLimit"] = "4Gi"
    good["status"] = {"fingerprint": "ab" * 8, "namespaceDigest": "ab" * 6, "configMap": "c", "readyPeers": 2,
                      "observedGeneration": 1, "conditions": r.pool_conditions(
                          None, invalid_message=None, generation=1, now="2026-01-01T00:00:00Z")}
    jsonschema.validate(json.loads(json.dumps(good)), schema)
    bad = copy.deepcopy(good)
    bad["spec"]["sidecar"]["transport"] = "rdma"
    with pytest.raises(jsonschema.ValidationError, match="rdma"):
        jsonschema.validate(bad, schema)
    assert schema["properties"]["spec"]["properties"]["sidecar"]["properties"]["basePort"]["default"] == 5710


def test_a_pod_translating_to_another_fingerprint_is_named_with_its_field_diff(config: OffloadingConfig) -> None:
    same = pod(vllm(["serve", "meta-llama/Llama-3.1-8B", "--port", "8000", "--block-size", "16",
                     "--kv-transfer-config", KTC]))
    assert r.pod_identity_problem(same, config, llama_config()) is None
    other = pod(vllm(["serve", "meta-llama/Llama-3.1-8B", "--block-size", "32", "--kv-transfer-config", KTC]))
    problem = r.pod_identity_problem(other, config, llama_config())
    assert problem is not None and config.fingerprint in problem and "tokens_per_block" in problem
    with pytest.raises(ValueError, match="no KV offloading connector"):
        r.pod_identity_problem(pod(vllm(["serve", "meta-llama/Llama-3.1-8B"])), config, llama_config())
