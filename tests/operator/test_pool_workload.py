"""A pool that reads its workload (spec.targetRef) and, opted in, gets kv-offload's --kv-transfer-config:
kopf's real runtime runs `kv-offload operator` against kmock's KubernetesEmulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kmock
import pytest
from kv_offload_operator.pools.kv_transfer import InjectedConnector
from kv_offload_operator.translation.translate import pool_config
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from operator_harness import (
    KTC,
    NAMESPACE,
    POOLS,
    POOLS_URL,
    create,
    llama_config,
    merge_patch,
    obj,
    pool_body,
)
from operator_process import OperatorProcess
from waiting import wait_for_async

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("cluster_within_rbac")]
APPS = f"/apis/apps/v1/namespaces/{NAMESPACE}"
LWS = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets"
SERVE = ["serve", "meta-llama/Llama-3.1-8B", "--port", "8000", "--block-size", "16"]


def template(args: list[str], *, env: list[dict[str, Any]] | None = None, pool: str = "llama",
             proxy: bool = True, image: str = "vllm/vllm-openai:v0.34.0") -> dict[str, Any]:
    """A pod template like vLLM's Kubernetes guide: the vLLM container beside a proxy."""
    containers = [{"name": "vllm", "image": image, "command": ["vllm"], "args": args,
                   "env": env or []}]
    if proxy:
        containers.insert(0, {"name": "proxy", "image": "envoyproxy/envoy:v1.31", "args": ["-c", "/etc/envoy.yaml"]})
    return {"metadata": {"labels": {"app": "llama", "kv-offload.io/pool": pool}},
            "spec": {"containers": containers}}


def deployment(name: str, args: list[str], **kw: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "llama"}}, "template": template(args, **kw)}}


def workload_pool(name: str, kind: str, target: str, api_version: str = "apps/v1", **spec: Any) -> dict[str, Any]:
    body = pool_body(name)
    del body["spec"]["vllmArgs"]
    body["spec"]["targetRef"] = {"apiVersion": api_version, "kind": kind, "name": target}
    body["spec"].update(spec)
    return body


def status_of(k: kmock.KubernetesEmulator, name: str) -> dict[str, Any]:
    return (obj(k, POOLS, name) or {}).get("status") or {}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def configmap_config(k: kmock.KubernetesEmulator, pool: str) -> OffloadingConfig | None:
    cm = obj(k, "v1/configmaps", f"{pool}-offloading-config")
    return OffloadingConfig.from_json(cm["data"]["offloading_config.json"]) if cm else None


async def test_a_pool_translates_its_deployments_vllm_container_and_follows_its_changes(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    args = [*SERVE, "--kv-transfer-config", KTC]
    env = [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"},
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    # The image names vLLM 0.33, whose rules apply (0.34 has no V1 runner and refuses the env).
    image = "vllm/vllm-openai:v0.33.0"
    expected = pool_config(["vllm", *args], llama_config(), env=v1, vllm_version="0.33")
    assert expected.fingerprint != pool_config(["vllm", *args], llama_config(),
                                               vllm_version="0.33").fingerprint  # the env matters
    wider = [*SERVE[:-1], "32", "--kv-transfer-config", KTC]
    changed = pool_config(["vllm", *wider], llama_config(), env=v1, vllm_version="0.33")
    assert changed.fingerprint != expected.fingerprint
    await create(kmock, f"{APPS}/deployments", deployment("llama", args, env=env, image=image))
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--model-config-check-seconds", "0.3"]):
        await create(kmock, POOLS_URL, workload_pool("llama", "Deployment", "llama"))
        fingerprint = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
        assert configmap_config(kmock, "llama") == expected and fingerprint == expected.fingerprint
        assert condition(status_of(kmock, "llama"), "Ready")["status"] == "True"
        assert "vllmArgs" not in obj(kmock, POOLS, "llama")["spec"]  # nothing copied into the spec
        digest = status_of(kmock, "llama")["workloadDigest"]

        # The Deployment's vLLM args change: the pool is translated again, without a spec change.
        assert status_of(kmock, "llama")["vllmVersion"] == "0.33 (from the vLLM image tag (vllm/vllm-openai:v0.33.0))"
        await merge_patch(kmock, f"{APPS}/deployments/llama",
                          {"spec": {"template": template(wider, env=env, image=image)}})
        await wait_for_async("the new fingerprint", lambda: status_of(kmock, "llama").get("fingerprint")
                             == changed.fingerprint)
        assert configmap_config(kmock, "llama") == changed
        assert status_of(kmock, "llama")["workloadDigest"] != digest
        assert status_of(kmock, "llama")["observedGeneration"] == 1


async def test_a_missing_workload_waits_with_a_clear_condition_and_is_read_once_it_exists(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    args = [*SERVE, "--kv-transfer-config", KTC]
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--model-config-check-seconds", "0.3"]):
        await create(kmock, POOLS_URL, workload_pool("llama", "Deployment", "llama-serving"))
        ready = await wait_for_async("the waiting condition", lambda: condition(status_of(kmock, "llama"), "Ready")
                                     .get("reason") == "Waiting" and condition(status_of(kmock, "llama"), "Ready"))
        assert ready["status"] == "False"
        assert ready["message"] == ("Deployment 'llama-serving' named by spec.targetRef does not exist in "
                                    "namespace 'ns1'; waiting for it")
        assert obj(kmock, "v1/configmaps", "llama-offloading-config") is None

        await create(kmock, f"{APPS}/deployments", deployment("llama-serving", args))
        await wait_for_async("Ready once the Deployment exists",
                             lambda: condition(status_of(kmock, "llama"), "Ready").get("status") == "True")
        assert configmap_config(kmock, "llama") == pool_config(["vllm", *args], llama_config())


async def test_a_workload_without_a_vllm_container_is_invalid_saying_how_to_name_it(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    body = deployment("two", [*SERVE, "--kv-transfer-config", KTC])
    containers = body["spec"]["template"]["spec"]["containers"]
    containers.append(dict(containers[1], name="vllm-2"))
    await create(kmock, f"{APPS}/deployments", body)
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, workload_pool("llama", "Deployment", "two"))
        invalid = await wait_for_async("the Invalid condition", lambda: condition(status_of(kmock, "llama"), "Invalid")
                                       .get("status") == "True" and condition(status_of(kmock, "llama"), "Invalid"))
        assert invalid["message"] == ("Deployment 'two' named by spec.targetRef: cannot tell which container runs "
                                      "vLLM (2 candidates); set annotation kv-offload.io/vllm-container: "
                                      "<container name> on its pod template")


async def test_a_workload_the_release_refuses_or_spanning_nodes_is_invalid_saying_why(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    v1 = [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"}]
    await create(kmock, f"{APPS}/deployments", deployment("v1", [*SERVE, "--kv-transfer-config", KTC], env=v1))
    wide = deployment("wide", [*SERVE, "-tp", "8", "--kv-transfer-config", KTC])
    wide["spec"]["template"]["spec"]["containers"][1]["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    await create(kmock, f"{APPS}/deployments", wide)
    await create(kmock, f"{APPS}/deployments",
                 deployment("nodes", [*SERVE, "-tp", "8", "--nnodes", "2", "--kv-transfer-config", KTC]))
    async with OperatorProcess(tmp_path, str(kmock.url)):
        for name in ("v1", "wide", "nodes"):
            await create(kmock, POOLS_URL, workload_pool(name, "Deployment", name))

        def invalid(name: str) -> str | None:
            c = condition(status_of(kmock, name), "Invalid")
            return c.get("message") if c.get("status") == "True" else None

        message = await wait_for_async("v1's Invalid condition", lambda: invalid("v1"))
        assert message == ("vLLM 0.34 does not start with this line: VLLM_USE_V2_MODEL_RUNNER=0 is no longer "
                           "supported: Model Runner V1 has been removed. Unset this variable.")
        message = await wait_for_async("wide's Invalid condition", lambda: invalid("wide"))
        assert "has 8 workers (tensor 8 x pipeline 1 x prefill context 1) but its pod has 4 accelerators" in message
        assert "give each engine at most one node's GPUs" in message
        message = await wait_for_async("nodes' Invalid condition", lambda: invalid("nodes"))
        assert message.startswith("the vLLM line spans 2 nodes per engine (--nnodes 2, --data-parallel-size 1)")


async def test_injected_kv_transfer_config_is_translated_for_a_statefulset_and_a_leader_worker_set(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    """spec.injectKVTransferConfig: a command line without --kv-transfer-config is translated
    with kv-offload's; one with its own keeps it."""
    connector = InjectedConnector(cpu_bytes_to_use=4 << 30, block_size=32)
    statefulset = {"apiVersion": "apps/v1", "kind": "StatefulSet",
                   "metadata": {"name": "llama", "namespace": NAMESPACE},
                   "spec": {"serviceName": "llama", "selector": {"matchLabels": {"app": "llama"}},
                            "template": template(SERVE)}}
    leader = template(["serve", "meta-llama/Llama-3.1-8B", "--block-size", "16", "--tensor-parallel-size", "2"],
                      proxy=False)
    worker = template(["--help"], proxy=False)
    worker["spec"]["containers"][0].update(name="ray-worker", command=["ray"], args=["start", "--block"])
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "llama-tp", "namespace": NAMESPACE},
           "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "leaderTemplate": leader,
                                                            "workerTemplate": worker}}}
    own = deployment("own", [*SERVE, "--kv-transfer-config", KTC])
    await create(kmock, f"{APPS}/statefulsets", statefulset)
    await create(kmock, LWS, lws)
    await create(kmock, f"{APPS}/deployments", own)
    inject = {"cpuBytesToUse": "4Gi", "blockSize": 32}
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, workload_pool("sts", "StatefulSet", "llama", injectKVTransferConfig=inject))
        await create(kmock, POOLS_URL, workload_pool("lws", "LeaderWorkerSet", "llama-tp",
                                                     api_version="leaderworkerset.x-k8s.io/v1",
                                                     injectKVTransferConfig=inject))
        await create(kmock, POOLS_URL, workload_pool("own", "Deployment", "own", injectKVTransferConfig=inject))
        for name in ("sts", "lws", "own"):
            await wait_for_async(f"pool {name}", lambda n=name: status_of(kmock, n).get("fingerprint"))
    ours = ["--kv-transfer-config", connector.text()]
    assert configmap_config(kmock, "sts") == pool_config(["vllm", *SERVE, *ours], llama_config())
    lws_config = configmap_config(kmock, "lws")
    assert lws_config == pool_config(["vllm", *leader["spec"]["containers"][0]["args"], *ours], llama_config())
    assert lws_config is not None and lws_config.parallel.tp_size == 2
    extra = lws_config.extra_config
    wanted = ("TieringOffloadingSpec", 4 << 30, 32)
    assert (extra["spec_name"], extra["cpu_bytes_to_use"], extra["block_size"]) == wanted
    assert [dict(t) for t in extra["secondary_tiers"]] == [
        {"type": "KVOffloadSecondaryTier", "module_path": "kv_offload_sidecar.engine.vllm_tier"}]
    assert configmap_config(kmock, "own") == pool_config(["vllm", *SERVE, "--kv-transfer-config", KTC],
                                                         llama_config())
    assert dict(configmap_config(kmock, "own").extra_config) == json.loads(KTC)["kv_connector_extra_config"]
