"""RDMA, host network, ports and memory through the running operator's webhook (real AdmissionReviews).

One emulated cluster (kmock) and one `kv-offload operator` process serve the
module; each patched pod is validated against the Kubernetes schema. The RDMA
pool and its Deployment are the chart's `examples/manifests/pool-rdma.yaml`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from operator_harness import NAMESPACE, create, llama_config, obj, pool_body
from webhook_support import Cluster, admitted, serving_cluster, vllm_pod

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]
EXAMPLE = Path(__file__).parents[2] / "charts" / "kv-offload" / "examples" / "manifests" / "pool-rdma.yaml"


def example() -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's pool (with a DRA claim and IPC_LOCK added) and a pod of its Deployment, in NAMESPACE."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(EXAMPLE.read_text())}
    pool, deployment = docs["KVOffloadPool"], docs["Deployment"]
    pool["metadata"].update(namespace=NAMESPACE, uid="uid-rdma")
    pool["spec"]["sidecar"]["rdma"].update(
        resourceClaims=[{"name": "rdma-nic", "resourceClaimTemplateName": "rdma-nic"}], ipcLock=True)
    template = deployment["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": dict(template["metadata"], generateName="llama-rdma-", namespace=NAMESPACE),
           "spec": template["spec"]}
    return pool, pod


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async def model_config_map(api: kmock.KubernetesEmulator) -> None:
        await create(api, f"/api/v1/namespaces/{NAMESPACE}/configmaps", {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "llama-3-1-8b-config", "namespace": NAMESPACE},
            "data": {"config.json": json.dumps(llama_config())}})

    pools = (example()[0], pool_body("plain", sidecar={"dataPlane": {"transport": "ucx"}}),
             pool_body("tcp", sidecar={"dataPlane": {"transport": "tcp"}, "dataPort": 7000}))
    async with serving_cluster(tmp_path_factory.mktemp("webhook-rdma"), pools, seed=model_config_map) as c:
        yield c



def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == "kv-offload-sidecar")


def host_pod(pool: str, **spec: Any) -> dict[str, Any]:
    pod = vllm_pod(pool, shm_volume=False)
    pod["spec"].update(spec)
    return pod


async def test_an_rdma_pod_on_the_host_network_gets_devices_claims_ipc_lock_host_ports_and_rc(
        cluster: Cluster) -> None:
    pod = example()[1]
    assert (pod["spec"]["hostNetwork"], pod["spec"]["hostIPC"], pod["spec"]["hostPID"]) == (True, True, True)
    result = admitted(pod, await cluster.webhook.admit(pod))
    sidecar = sidecar_of(result)
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["UCX_TLS"] == "rc,sm,self,tcp" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    resources = sidecar["resources"]
    assert resources["limits"] == {"rdma/ib": "1"}
    # store + 256 MiB; a GPU pod's sidecar asks the CPUs its lanes need (pod_defaults)
    assert resources["requests"] == {"memory": "16640Mi", "cpu": "4", "rdma/ib": "1"}
    assert resources["claims"] == [{"name": "rdma-nic"}]
    assert result["spec"]["resourceClaims"] == [{"name": "rdma-nic", "resourceClaimTemplateName": "rdma-nic"}]
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert (sidecar["securityContext"]["runAsUser"], sidecar["securityContext"]["runAsNonRoot"]) == (0, False)
    # The node's ports: declared as host ports, so the scheduler keeps colliding pods apart.
    assert [(p["name"], p["containerPort"], p["hostPort"]) for p in sidecar["ports"]] == [
        ("kvo-metrics", 6710, 6710), ("kvo-data", 6810, 6810)]
    argv = sidecar["args"]
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert (flags["--base-port"], flags["--data-port"], flags["--capacity-bytes"]) == ("6710", "6810", str(16 << 30))
    vllm_env = {e["name"]: e.get("value") for e in result["spec"]["containers"][0]["env"]}
    assert vllm_env["VLLM_P2P_SIDE_CHANNEL_PORT"] == "6710"
    shm = next(v for v in result["spec"]["volumes"] if v["name"] == "kv-offload-shm")
    assert shm["emptyDir"]["sizeLimit"] == "25Gi"  # 16 GiB store + 8 GiB primary tier + 1 GiB


async def test_a_pod_sharing_only_the_hosts_ipc_namespace_is_denied_while_ucx_may_use_shared_memory(
        cluster: Cluster) -> None:
    response = await cluster.webhook.admit(host_pod("plain", hostIPC=True))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("The pod cannot join KVOffloadPool 'plain' in namespace 'ns1': the pod sets "
                              "hostIPC but not hostPID, and UCX_TLS=tcp,sm,self lets UCX use shared memory")
    assert "set both hostIPC and hostPID, neither, or spec.sidecar.ucxTransports: tcp." in message
    # The tcp transport has no UCX: the same pod is admitted there.
    assert (await cluster.webhook.admit(host_pod("tcp", hostIPC=True)))["allowed"] is True


async def test_a_host_network_pod_whose_container_takes_a_sidecar_port_is_denied_naming_both(
        cluster: Cluster) -> None:
    pod = host_pod("tcp", hostNetwork=True)
    pod["spec"]["containers"][0]["ports"].append({"name": "metrics", "containerPort": 7000, "protocol": "TCP"})
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "container 'vllm' declares containerPort 7000, which the sidecar needs for kvo-data" in message
    assert "spec.sidecar.basePort / spec.sidecar.dataPort" in message
    pod["spec"]["containers"][0]["ports"].pop()
    sidecar = sidecar_of(admitted(pod, await cluster.webhook.admit(pod)))
    assert [(p["containerPort"], p["hostPort"]) for p in sidecar["ports"]] == [(5710, 5710), (7000, 7000)]


async def test_a_pods_own_dev_shm_is_raised_to_hold_the_store_and_vllms_primary_tier(cluster: Cluster) -> None:
    pod = vllm_pod("plain")  # its own /dev/shm emptyDir, sizeLimit 2Gi
    result = admitted(pod, await cluster.webhook.admit(pod))
    dshm = next(v for v in result["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "15Gi"}  # 4 GiB store + 10 GiB + 1 GiB
    assert "kv-offload-shm" not in {v["name"] for v in result["spec"]["volumes"]}
    assert "readinessProbe" not in sidecar_of(result)


async def test_the_peer_service_carries_the_pools_data_port(cluster: Cluster) -> None:
    svc = obj(cluster.api, "v1/services", "llama-rdma-peers")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"kvo-ctrl-0": 6710, "kvo-data": 6810}
    svc = obj(cluster.api, "v1/services", "tcp-peers")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"kvo-ctrl-0": 5710, "kvo-data": 7000}
