"""The webhook admits the pods of a pool that reads its workload (spec.targetRef) and adds kv-offload's
--kv-transfer-config where the pool asks for it (spec.injectKVTransferConfig): real AdmissionReviews to
the running operator, the emulated cluster holding the Deployment."""

from __future__ import annotations

import json
import shlex
from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
import pytest_asyncio
from kv_offload_operator.pools.kv_transfer import InjectedConnector
from operator_harness import KTC, NAMESPACE, POOLS, create, obj, pool_body
from webhook_support import Cluster, admitted, serving_cluster, vllm_pod

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]
SCRIPT = "vllm serve meta-llama/Llama-3.1-8B --port 8000 --block-size 16"


def deployment(name: str, script: str) -> dict[str, Any]:
    pod = vllm_pod("served")
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"selector": {"matchLabels": {"app": "llama"}},
                     "template": {"metadata": {"labels": pod["metadata"]["labels"]},
                                  "spec": dict(pod["spec"], containers=[
                                      dict(pod["spec"]["containers"][0], args=[script])])}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async def workload(api: kmock.KubernetesEmulator) -> None:
        await create(api, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
                     deployment("llama", f"{SCRIPT} --kv-transfer-config '{KTC}'"))

    served = pool_body("served")
    del served["spec"]["vllmArgs"]
    served["spec"]["targetRef"] = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"}
    injecting = pool_body("injecting", vllm_args=shlex.split(SCRIPT))
    injecting["spec"]["injectKVTransferConfig"] = {"cpuBytesToUse": "2Gi", "blockSize": 32}
    async with serving_cluster(tmp_path_factory.mktemp("webhook-workload"), (served, injecting),
                               seed=workload) as c:
        yield c



async def test_a_pod_of_the_targeted_deployment_is_admitted_and_another_command_line_is_refused(
        cluster: Cluster) -> None:
    pod = vllm_pod("served", script=f"{SCRIPT} --kv-transfer-config '{KTC}'")
    result = admitted(pod, await cluster.webhook.admit(pod))
    assert result["metadata"]["annotations"]["kv-offload.io/injected"] == \
        obj(cluster.api, POOLS, "served")["status"]["fingerprint"]
    other = vllm_pod("served", script=f"{SCRIPT.replace('16', '32')} --kv-transfer-config '{KTC}'")
    response = await cluster.webhook.admit(other)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "tokens_per_block" in message
    assert message.endswith("make the container's vllm serve arguments match the pool's Deployment 'llama' "
                            "container 'vllm'.")


async def test_a_pod_without_a_kv_transfer_config_gets_the_pools_injected_one(cluster: Cluster) -> None:
    pod = vllm_pod("injecting", script=SCRIPT)
    result = admitted(pod, await cluster.webhook.admit(pod))
    script = result["spec"]["containers"][0]["args"][0]
    connector = InjectedConnector(cpu_bytes_to_use=2 << 30, block_size=32)
    assert script == f"{SCRIPT} --kv-transfer-config {shlex.quote(connector.text())}"
    cm = obj(cluster.api, "v1/configmaps", "injecting-offloading-config")
    extra = json.loads(cm["data"]["offloading_config.json"])["extra_config"]
    assert extra == connector.config()["kv_connector_extra_config"]
    own = vllm_pod("injecting", script=f"{SCRIPT} --kv-transfer-config '{KTC}'")  # another connector config
    response = await cluster.webhook.admit(own)
    assert response["allowed"] is False and "fingerprint" in response["status"]["message"]
