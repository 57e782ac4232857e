"""The operator, started with the chart's own arguments and certificate, answers like in a cluster.

Against kmock's Kubernetes emulator on 127.0.0.1, as an install would: the
chart's certificate Jobs run (the create Job writes the webhook Secret, the
patch Job puts its CA into the applied MutatingWebhookConfiguration), then
`kv-offload operator` runs as a process with the flags the chart's Deployment
renders and the key pair from that Secret. Then, as the kubelet, `helm test`,
the API server and Prometheus would: /healthz answers 200 (and the helm test
pod's script exits 0); an AdmissionReview posted over HTTPS to the chart's
webhook path, trusting only the caBundle the Job wrote and naming the chart's
Service, gets the operator's answer; the ServiceMonitor's endpoint serves the
operator's metrics, which counted that answer.
"""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from chart_support import FULLNAME, NAMESPACE, find, webhook_cert_job_argv
from kv_offload_operator.webhook.certificate import decode_secret_data
from operator_process import KV_OFFLOAD, OperatorProcess
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for_async

pytestmark = pytest.mark.timeout(240)

WEBHOOK_DNS = f"{FULLNAME}.{NAMESPACE}.svc"
POD_NAMESPACE = "inference"


def emulate_cluster(k: kmock.KubernetesEmulator) -> None:
    """Discovery for what the operator and the certificate Jobs read and write."""
    verbs = {"list", "watch", "get", "patch", "create", "delete"}
    k.resources["kv-offload.io/v1alpha1/kvoffloadpools"] = kmock.ResourceInfo(
        kind="KVOffloadPool", namespaced=True, verbs=verbs, subresources={"status"})
    k.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
        kind="ClusterKopfPeering", namespaced=False, verbs=verbs)
    k.resources["admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"] = kmock.ResourceInfo(
        kind="MutatingWebhookConfiguration", namespaced=False, verbs=verbs)
    # kopf waits for these in discovery before it watches anything (the peering object included).
    k.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs)
    for plural, kind in (("pods", "Pod"), ("configmaps", "ConfigMap"), ("secrets", "Secret"),
                         ("services", "Service"), ("events", "Event")):
        k.resources[f"v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)


def chart_operator_argv(objects: list[dict[str, Any]], cert_dir: Path, operator: OperatorProcess) -> list[str]:
    """The Deployment's args with the pod-local paths and ports moved to this host."""
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    moved = {"--webhook-cert-dir": str(cert_dir), "--webhook-port": str(operator.webhook_port),
             "--health-port": str(operator.health_port), "--metrics-port": str(operator.metrics_port)}
    argv = []
    for arg in container["args"]:
        flag, eq, _ = arg.partition("=")
        argv.append(f"{flag}={moved[flag]}" if eq and flag in moved else arg)
    return [KV_OFFLOAD, *argv, "--webhook-addr", "127.0.0.1"]


async def healthy(url: str, operator: OperatorProcess) -> bool:
    """Whether ``url`` answers 200; fails at once with the log when the operator has exited."""
    assert operator.proc is not None
    if operator.proc.returncode is not None:
        pytest.fail(f"operator exited with {operator.proc.returncode}:\n{operator.log()[-4000:]}")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as reply:
                return reply.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def admission_review(pod: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": POD_NAMESPACE, "operation": "CREATE", "object": pod, "oldObject": None,
        "dryRun": False, "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


async def api(k: kmock.KubernetesEmulator, method: str, url: str, body: Any = None) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, str(k.url).rstrip("/") + url, json=body) as reply:
            assert reply.status in (200, 201), await reply.text()
            return await reply.json()


async def run_certificate_job(objects: list[dict[str, Any]], step: str, kubeconfig: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *webhook_cert_job_argv(objects, step), env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"webhook-cert {step}: {err.decode()}"


async def test_operator_answers_health_webhook_and_metrics_with_the_chart_arguments_and_certificate(
        kmock: kmock.KubernetesEmulator, render, tmp_path: Path) -> None:
    objects = render({"monitoring": {"serviceMonitor": {"enabled": True}}})
    emulate_cluster(kmock)
    operator = OperatorProcess(tmp_path, str(kmock.url),
                               command=lambda op: chart_operator_argv(objects, cert_dir, op))
    kubeconfig = operator.kubeconfig
    # helm install: the pre-install Job, the manifests, the post-install Job.
    await run_certificate_job(objects, "create", kubeconfig)
    await api(kmock, "POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
              find(objects, "MutatingWebhookConfiguration"))
    await run_certificate_job(objects, "patch", kubeconfig)
    secret = await api(kmock, "GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}-webhook-tls")
    (hook,) = (await api(kmock, "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/"
                                       f"{FULLNAME}"))["webhooks"]
    cert_dir = tmp_path / "webhook-tls"
    cert_dir.mkdir()
    for volume in find(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "webhook-tls":  # what the kubelet mounts from the Secret
            assert volume["secret"]["secretName"] == secret["metadata"]["name"]
            for item in volume["secret"]["items"]:
                (cert_dir / item["path"]).write_bytes(decode_secret_data(secret["data"])[item["key"]])
    async with operator:
        health_port, webhook_port, metrics_port = operator.health_port, operator.webhook_port, operator.metrics_port
        await wait_for_async("the operator's /healthz", lambda: healthy(f"http://127.0.0.1:{health_port}/healthz",
                                                                        operator))

        # The helm test pod's own script, its Service URL pointed at this host.
        script = find(objects, "Pod")["spec"]["containers"][0]["command"][-1]
        local = script.replace(f"http://{WEBHOOK_DNS}:8080", f"http://127.0.0.1:{health_port}")
        test_pod = await asyncio.create_subprocess_exec(sys.executable, "-c", local)
        assert await asyncio.wait_for(test_pod.wait(), 30) == 0

        # The API server's call: HTTPS to service/path, trusting the caBundle only.
        trust = ssl.create_default_context(cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode())
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"generateName": "llama-", "namespace": POD_NAMESPACE,
                            "labels": {"kv-offload.io/pool": "no-such-pool"}},
               "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.34.0",
                                        "args": ["vllm", "serve", "meta-llama/Llama-3.1-8B"]}]}}
        review = admission_review(pod)
        url = f"https://127.0.0.1:{webhook_port}{hook['clientConfig']['service']['path']}"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=review, ssl=trust, server_hostname=WEBHOOK_DNS,
                                    timeout=aiohttp.ClientTimeout(total=hook["timeoutSeconds"])) as reply:
                assert reply.status == 200, await reply.text()
                answer = await reply.json()
        response = answer["response"]
        assert answer["kind"] == "AdmissionReview" and response["uid"] == review["request"]["uid"]
        # The operator's verdict for a pod whose pool does not exist: refused, with a sentence.
        assert response["allowed"] is False
        assert "no-such-pool" in response["status"]["message"]

        # Prometheus, through the ServiceMonitor's endpoint: the answer is counted; this replica leads.
        (endpoint,) = find(objects, "ServiceMonitor")["spec"]["endpoints"]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{metrics_port}{endpoint['path']}") as reply:
                assert reply.status == 200
                samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                           for f in text_string_to_metric_families(await reply.text()) for s in f.samples}
        denied = ("kv_offload_operator_admissions_total", (("reason", "pool_not_found"), ("result", "denied")))
        assert samples[denied] == 1
        await wait_for_async("this replica leading", lambda: leads(metrics_port, endpoint["path"]))
        peering = await api(kmock, "GET", f"/apis/kopf.dev/v1/clusterkopfpeerings/{FULLNAME}")
        assert len(peering.get("status") or {}) == 1  # this replica's keep-alive


async def leads(port: int, path: str) -> bool:
    """Whether kv_offload_operator_leader is 1: the replica has read its peering object and leads."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as reply:
            text = await reply.text()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kv_offload_operator_leader") == 1
