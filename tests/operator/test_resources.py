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


# ---- hash seed, UCX settings, metrics port ---------------------------------------

def env_of(c: dict[str, Any]) -> dict[str, Any]:
    names = [e["name"] for e in c.get("env") or []]
    assert len(names) == len(set(names)), f"repeated env names: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}


def hash_seed_pool(seed: Any = None, **sidecar: Any) -> dict[str, Any]:
    body = pool(**sidecar)
    if seed is not None:
        body["spec"]["hashSeed"] = seed
    return body


def inject_into(body: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    spec = r.SidecarSpec.from_pool(body, default_image="img:1")
    return jsonpatch.JsonPatch(r.pod_patch(p, body, fingerprint="f" * 16, sidecar=spec)).apply(copy.deepcopy(p))


@pytest.mark.parametrize("seed", [None, "1234"])
def test_vllm_and_sidecar_get_the_pools_hash_seed_which_the_sidecar_states_in_its_handshake(seed: str | None) -> None:
    from kv_offload_sidecar.settings import effective_hash_seed

    out = inject_into(hash_seed_pool(seed), pod(vllm()))
    wanted = seed or "0"
    vllm_env = env_of(out["spec"]["containers"][0])
    sidecar_env = env_of(out["spec"]["initContainers"][1])
    assert vllm_env["PYTHONHASHSEED"] == sidecar_env["PYTHONHASHSEED"] == wanted
    # What the sidecar process derives from that environment and the pool's config.
    config = translate(LLAMA_ARGS, llama_config())
    assert effective_hash_seed(config, {k: v for k, v in sidecar_env.items() if isinstance(v, str)}) == wanted
    kubernetes_validate.validate(out, K8S, strict=True)


def test_a_vllm_container_already_setting_the_pools_seed_keeps_one_entry() -> None:
    out = inject_into(hash_seed_pool("42"), pod(vllm(env=[{"name": "PYTHONHASHSEED", "value": "42"}])))
    assert env_of(out["spec"]["containers"][0])["PYTHONHASHSEED"] == "42"
    script = f"PYTHONHASHSEED=42 vllm serve meta-llama/Llama-3.1-8B --kv-transfer-config '{KTC}'"
    out = inject_into(hash_seed_pool("42"), pod(vllm(command=["/bin/sh", "-c"], args=[script])))
    assert env_of(out["spec"]["containers"][0])["PYTHONHASHSEED"] == "42"


@pytest.mark.parametrize("container, said", [
    (vllm(env=[{"name": "PYTHONHASHSEED", "value": "7"}]), "sets PYTHONHASHSEED='7'"),
    (vllm(command=["/bin/sh", "-c"], args=[
        f"PYTHONHASHSEED=7 vllm serve meta-llama/Llama-3.1-8B --kv-transfer-config '{KTC}'"]),
     "command line sets PYTHONHASHSEED='7'"),
])
def test_a_vllm_container_with_another_hash_seed_is_refused_saying_how_to_fix_it(
        container: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError) as info:
        inject_into(hash_seed_pool(), pod(container))
    message = str(info.value)
    assert said in message and "spec.hashSeed is '0'" in message
    assert "remove PYTHONHASHSEED" in message and "spec.hashSeed: '7'" in message


def test_a_hash_seed_from_value_from_is_refused_because_it_cannot_be_checked() -> None:
    container = vllm(env=[{"name": "PYTHONHASHSEED", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}])
    with pytest.raises(ValueError, match="PYTHONHASHSEED with valueFrom"):
        inject_into(hash_seed_pool(), pod(container))


@pytest.mark.parametrize("bad", ["abc", "-1", "4294967296", "", " 1", True, 1.5, "random"])
def test_hash_seed_must_be_a_seed_python_accepts(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"spec\.hashSeed=.*decimal integer in \[0, 4294967295\]"):
        r.SidecarSpec.from_pool(hash_seed_pool(bad), default_image="img:1")
    assert r.SidecarSpec.from_pool(hash_seed_pool("4294967295"), default_image="img:1").hash_seed == "4294967295"


def test_a_pool_whose_connector_config_names_another_hash_seed_is_a_problem() -> None:
    ktc = json.loads(KTC)
    ktc["kv_connector_extra_config"]["hash_seed"] = "9"
    stated = translate(["vllm", "serve", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", json.dumps(ktc)],
                       llama_config())
    problem = r.pool_hash_seed_problem(stated, "0")
    assert problem is not None and "spec.hashSeed: '9'" in problem
    assert r.pool_hash_seed_problem(stated, "9") is None
    assert r.pool_hash_seed_problem(translate(LLAMA_ARGS, llama_config()), "0") is None


def test_a_ucx_sidecar_gets_cross_node_ucx_settings_and_sidecar_env_overrides_them() -> None:
    ucx = env_of(inject_into(hash_seed_pool(), pod(vllm()))["spec"]["initContainers"][1])
    assert (ucx["UCX_TLS"], ucx["UCX_TCP_TX_SEG_SIZE"], ucx["UCX_TCP_RX_SEG_SIZE"]) == ("tcp,sm,self", "1m", "1m")
    tcp = env_of(inject_into(hash_seed_pool(transport="tcp"), pod(vllm()))["spec"]["initContainers"][1])
    assert not {k for k in tcp if k.startswith("UCX_")}

    own = [{"name": "UCX_TLS", "value": "rc,sm,self"}, {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    out = inject_into(hash_seed_pool(env=own), pod(vllm()))
    env = env_of(out["spec"]["initContainers"][1])
    assert env["UCX_TLS"] == "rc,sm,self" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env["UCX_TCP_TX_SEG_SIZE"] == "1m" and env["NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "UCX_TLS" not in env_of(out["spec"]["containers"][0])  # only the sidecar speaks UCX
    kubernetes_validate.validate(out, K8S, strict=True)


@pytest.mark.parametrize("env, said", [
    ([{"name": "PYTHONHASHSEED", "value": "1"}], r"spec\.sidecar\.env\[0\] sets PYTHONHASHSEED.*spec\.hashSeed"),
    ([{"name": "VLLM_P2P_SIDE_CHANNEL_PORT", "value": "1"}], r"env\[0\] sets VLLM_P2P_SIDE_CHANNEL_PORT"),
    ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], r"env\[1\] repeats A"),
    ([{"value": "1"}], r"env\[0\] has no name"),
    ([{"name": "A"}], r"env\[0\] \(A\) needs exactly one of"),
    ("UCX_TLS=tcp", r"spec\.sidecar\.env must be a list"),
])
def test_bad_sidecar_env_is_refused_naming_the_entry(env: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        r.SidecarSpec.from_pool(hash_seed_pool(env=env), default_image="img:1")


@pytest.mark.parametrize("dp_indices", [(0,), (2, 3), (5,), (4, 5, 6, 7)])
def test_the_first_control_port_is_kvo_metrics_whatever_the_dp_start_rank(dp_indices: tuple[int, ...]) -> None:
    container = r.sidecar_container(pool_name="llama", namespace="ns1", sidecar=sidecar_spec(),
                                    dp_indices=dp_indices, shm_volume=r.SHM_VOLUME)
    ports = [(p["name"], p["containerPort"]) for p in container["ports"]]
    assert ports == [("kvo-metrics", 5710 + dp_indices[0])] + \
        [(f"kvo-ctrl-{i}", 5710 + i) for i in dp_indices[1:]] + [("kvo-data", 5810)]
    assert container["readinessProbe"]["httpGet"]["port"] == 5710 + dp_indices[0]


def test_crd_schema_defaults_hash_seed_to_0_and_accepts_sidecar_env(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_props = schema["properties"]["spec"]["properties"]
    assert spec_props["hashSeed"]["default"] == r.DEFAULT_HASH_SEED
    assert "PYTHONHASHSEED" in spec_props["hashSeed"]["description"]
    assert "UCX_TLS=tcp,sm,self" in spec_props["sidecar"]["properties"]["env"]["description"]
    good = hash_seed_pool("17", env=[{"name": "UCX_TLS", "value": "tcp,self"},
                                     {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}])
    jsonschema.validate(good, schema)
    for bad_seed in ("seventeen", 17, "12345678901"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(hash_seed_pool(bad_seed), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(hash_seed_pool(env=[{"value": "no name"}]), schema)


@pytest.mark.timeout(120)
def test_real_ucx_sidecars_run_with_the_injected_env_and_share_chunks() -> None:
    """The env sidecar_env builds (UCX_TLS=tcp,sm,self, the pool's PYTHONHASHSEED) in real processes."""
    import os

    from kv_offload_sidecar.local_pool import LocalPool, example_config

    spec = r.SidecarSpec.from_pool(hash_seed_pool("4321"), default_image="img:1")
    injected = {e["name"]: e["value"] for e in r.sidecar_env(spec) if "value" in e
                and not e["name"].startswith("VLLM_P2P_")}  # LocalPool passes host and ports as flags
    assert injected["UCX_TLS"] == "tcp,sm,self" and injected["PYTHONHASHSEED"] == "4321"
    chunk = example_config().kv_bytes_per_chunk
    keys = [os.urandom(32) + bytes(4) for _ in range(4)]
    data = {k: os.urandom(chunk) for k in keys}
    with LocalPool(2, transport="ucx", capacity_bytes=64 * chunk, env=injected) as pool:
        a, b = pool.client(0), pool.client(1)
        assert a.store(keys, lambda i, view: view.__setitem__(slice(None), data[keys[i]])) == 4
        pool.wait_summaries()
        got: dict[int, bytes] = {}
        assert b.load(keys, lambda i, view: got.__setitem__(i, bytes(view)), 10.0) == 4
        assert [got[i] for i in range(4)] == [data[k] for k in keys]
        assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") == 4 * chunk
        a.close()
        b.close()
