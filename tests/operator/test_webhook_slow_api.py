"""The webhook against a slow API server: a pool the operator watches needs no read, and reads
give up within their budget (``admission.READS_TIMEOUT_SECONDS``): the pod gets a retryable
denial well before the API server would give up on the webhook (``webhook.timeoutSeconds``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from kv_offload_operator.webhook.admission import READS_TIMEOUT_SECONDS
from metrics_support import value, wait_for_metrics
from operator_harness import NAMESPACE, pool_body
from webhook_support import serving_cluster, vllm_pod

pytestmark = pytest.mark.timeout(240)
WEBHOOK_TIMEOUT_SECONDS = 10  # the chart's webhook.timeoutSeconds (tests/chart holds the budget below it)


async def test_an_unanswered_pool_read_denies_before_the_webhook_times_out_and_a_watched_pool_needs_no_read(
        tmp_path: Path) -> None:
    answered = asyncio.Event()  # released when the test ends: the API server never answers before

    async def never_answers() -> int:
        await answered.wait()
        return 500

    async def slow_reads(api) -> None:  # every read of a pool by name hangs
        for pool in ("slow", "llama"):
            api[f"get /apis/kv-offload.io/v1alpha1/namespaces/{NAMESPACE}/kvoffloadpools/{pool}"] << never_answers

    try:
        async with serving_cluster(tmp_path, [pool_body("llama")], seed=slow_reads) as cluster:
            # The API server's own deadline on the webhook call, as the client's.
            cluster.webhook.client_timeout = aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_SECONDS)
            denied = await cluster.webhook.admit(vllm_pod("slow"))
            assert denied["allowed"] is False
            assert denied["status"]["code"] == 503
            assert "did not answer the kv-offload operator's reads of KVOffloadPool 'slow'" in \
                denied["status"]["message"]
            assert f"within {READS_TIMEOUT_SECONDS:g} s" in denied["status"]["message"]
            # The pool the operator reconciles is known from its watch: its pods need no read.
            assert (await cluster.webhook.admit(vllm_pod("llama")))["allowed"] is True
            samples = await wait_for_metrics(cluster.operator.metrics_port, log=cluster.operator.log)
            assert value(samples, "kv_offload_operator_webhook_errors_total", reason="api_timeout") == 1
            assert value(samples, "kv_offload_operator_admissions_total", result="denied",
                         reason="pool_unreadable") == 1
    finally:
        answered.set()
