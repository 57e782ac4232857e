"""The operator's /metrics after real reconciles and real HTTPS admissions (kmock, kopf's runtime).

Every value is read back over HTTP from the running `kv-offload operator`
process, after the cluster events and AdmissionReviews that must have moved it.
"""

from __future__ import annotations

from pathlib import Path

import kmock
import pytest
from metrics_support import value, wait_for_metrics
from operator_harness import (
    NAMESPACE,
    POOLS,
    POOLS_URL,
    create,
    obj,
    pool_body,
)
from operator_process import OperatorProcess
from waiting import wait_for_async
from webhook_support import Webhook, vllm_pod

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("cluster_within_rbac")]

BAD_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16"]  # no offloading connector
ADMISSIONS = "kv_offload_operator_admissions_total"


def conditions(k: kmock.KubernetesEmulator, name: str) -> list[dict]:
    return ((obj(k, POOLS, name) or {}).get("status") or {}).get("conditions") or []


async def test_reconciles_admissions_translation_errors_and_pools_by_condition_are_counted(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    # The API server fails reads of this one pool: the webhook cannot decide.
    kmock[f"get /apis/kv-offload.io/v1alpha1/namespaces/{NAMESPACE}/kvoffloadpools/unreadable"] << 500
    async with OperatorProcess(tmp_path, str(kmock.url), webhook_tls=True) as operator:
        before = await wait_for_metrics(operator.metrics_port, log=operator.log)
        assert value(before, "kv_offload_operator_leader") == 1  # alone: it reconciles
        assert value(before, ADMISSIONS, result="denied", reason="pod_mismatch") == 0  # pre-created series
        for condition in ("Ready", "Invalid", "Waiting", "Pending"):
            assert value(before, "kv_offload_operator_pools", condition=condition) == 0

        await create(kmock, POOLS_URL, pool_body("llama"))
        await create(kmock, POOLS_URL, pool_body("broken", vllm_args=BAD_ARGS))
        for name in ("llama", "broken"):
            await wait_for_async(f"pool {name} reconciled", lambda n=name: conditions(kmock, n))

        webhook = Webhook(operator.webhook_port, operator.ca)
        await webhook.wait_listening()
        allowed = await webhook.admit(vllm_pod("llama"))
        assert allowed["allowed"] is True
        injected = vllm_pod("llama")
        injected["metadata"]["annotations"] = {"kv-offload.io/injected": "0123456789abcdef"}
        assert (await webhook.admit(injected))["allowed"] is True
        for pool, reason in (("missing", "pool_not_found"), ("broken", "pool_invalid"),
                             ("unreadable", "pool_unreadable")):
            answer = await webhook.admit(vllm_pod(pool))
            assert answer["allowed"] is False, (pool, answer)

        samples = await wait_for_metrics(operator.metrics_port, lambda s: value(
            s, "kv_offload_operator_pools", condition="Invalid") == 1, log=operator.log)
        assert value(samples, ADMISSIONS, result="allowed", reason="injected") == 1
        assert value(samples, ADMISSIONS, result="allowed", reason="already_injected") == 1
        for reason in ("pool_not_found", "pool_invalid", "pool_unreadable"):
            assert value(samples, ADMISSIONS, result="denied", reason=reason) == 1, reason
        assert value(samples, ADMISSIONS, result="denied", reason="operator_error") == 0
        assert value(samples, "kv_offload_operator_webhook_errors_total", reason="api_error") == 1
        assert value(samples, "kv_offload_operator_webhook_errors_total", reason="internal_error") == 0
        assert value(samples, "kv_offload_operator_reconciles_total", result="ok") >= 1
        assert value(samples, "kv_offload_operator_reconciles_total", result="invalid") >= 1
        assert value(samples, "kv_offload_operator_reconciles_total", result="error") == 0
        assert value(samples, "kv_offload_operator_translation_errors_total") >= 1
        assert value(samples, "kv_offload_operator_pools", condition="Ready") == 1
        assert value(samples, "kv_offload_operator_pools", condition="Invalid") == 1
        assert value(samples, "process_resident_memory_bytes") > 0

        # A deleted pool leaves the gauge.
        resp = await kmock.delete(f"{POOLS_URL}/broken")
        assert resp.status == 200
        await wait_for_metrics(operator.metrics_port, lambda s: value(
            s, "kv_offload_operator_pools", condition="Invalid") == 0, log=operator.log)

