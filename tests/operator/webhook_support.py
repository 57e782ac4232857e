"""A client of the running operator's admission webhook, and the pods it is sent."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kmock
import kubernetes_validate
from operator_harness import KTC, POOLS, POOLS_URL, assert_within_rbac, create, emulate_cluster, obj
from operator_process import OperatorProcess
from waiting import listening, wait_for_async

WEBHOOK_PATH = "/inject_sidecar"  # kopf serves each admission handler at /<handler id>
KUBERNETES_VERSION = "1.33.0"  # native sidecars (initContainers[].restartPolicy) are GA since 1.33
SIDECAR_NAME = "kv-offload-sidecar"


def vllm_pod(pool: str | None = "llama", *, script: str | None = None,
             shm_volume: bool = True) -> dict[str, Any]:
    """A pod as a Deployment's ReplicaSet submits it, running vLLM like vLLM's own k8s guide."""
    script = script or (
        "vllm serve meta-llama/Llama-3.1-8B --port 8000 --block-size 16 "
        f"--gpu-memory-utilization 0.9 --kv-transfer-config '{KTC}'")
    labels = {"app": "llama", "pod-template-hash": "6d8b7c9f4"}
    if pool is not None:
        labels["kv-offload.io/pool"] = pool
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": "llama-6d8b7c9f4-", "namespace": "ns1", "labels": labels,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-6d8b7c9f4",
                                 "uid": "0b6a3a64-1111-4c55-9c1e-3f2d7b5a9e01", "controller": True,
                                 "blockOwnerDeletion": True}]},
        "spec": {
            "containers": [{
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.34.0",
                "command": ["/bin/sh", "-c"],
                "args": [script],
                "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}],
                "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "64Gi"},
                              "requests": {"cpu": "4", "memory": "32Gi"}},
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5},
                "volumeMounts": [{"name": "cache", "mountPath": "/root/.cache/huggingface"}],
            }],
            "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
        },
    }
    if shm_volume:
        pod["spec"]["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        pod["spec"]["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
    return pod


def review(pod: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()),
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "ns1", "operation": "CREATE",
        "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
        "object": pod, "oldObject": None, "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


class Webhook:
    """An HTTPS client of the operator's webhook that trusts only the test CA."""

    def __init__(self, port: int, ca: Path) -> None:
        self.port = port
        self.url = f"https://127.0.0.1:{port}{WEBHOOK_PATH}"
        self.ssl = ssl.create_default_context(cafile=str(ca))
        # How long a post may take: the API server's own deadline on the webhook call, when a test sets it.
        self.client_timeout = aiohttp.ClientTimeout()

    async def admit(self, pod: dict[str, Any]) -> dict[str, Any]:
        request = review(pod)
        async with aiohttp.ClientSession(timeout=self.client_timeout) as session:
            async with session.post(self.url, json=request, ssl=self.ssl) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == request["request"]["uid"]
        return answer["response"]

    async def wait_listening(self) -> None:
        await wait_for_async("the webhook server listening", lambda: listening(self.port))


def admitted(pod: dict[str, Any], response: dict[str, Any], *, validate: bool = True) -> dict[str, Any]:
    """The pod as an allowing ``response`` patches it (an independent RFC 6902 implementation),
    checked against the Kubernetes schemas unless ``validate`` is False."""
    assert response["allowed"] is True, response.get("status")
    ops = json.loads(base64.b64decode(response["patch"]))
    result = jsonpatch.JsonPatch(ops).apply(copy.deepcopy(pod))
    if validate:
        kubernetes_validate.validate(result, KUBERNETES_VERSION, strict=True)
    return result


def sidecar_flags(pod: dict[str, Any]) -> dict[str, str]:
    """The injected sidecar's ``--flag value`` pairs."""
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    argv = sidecar["args"]
    return dict(zip(argv[1::2], argv[2::2]))


@dataclass
class Cluster:
    """The emulated API server, the operator process serving it and a client of its webhook."""

    api: kmock.KubernetesEmulator
    operator: OperatorProcess
    webhook: Webhook


@contextlib.asynccontextmanager
async def serving_cluster(workdir: Path, pools: Sequence[dict[str, Any]], *, status_field: str = "fingerprint",
                          seed: Callable[[kmock.KubernetesEmulator], Awaitable[None]] | None = None,
                          operator_args: Sequence[str] = ()) -> AsyncIterator[Cluster]:
    """An emulated cluster (``seed`` creates its first objects) and an operator (run with
    ``operator_args``) whose webhook serves a test CA's certificate, once it has processed ``pools``
    (each shows ``status_field``) and listens; on leaving, the operator's API requests are checked
    against the chart's RBAC."""
    async with kmock.KubernetesEmulator() as api, kmock.Server(api):
        emulate_cluster(api)
        if seed is not None:
            await seed(api)
        async with OperatorProcess(workdir, str(api.url), extra_args=operator_args, webhook_tls=True) as operator:
            for body in pools:
                await create(api, POOLS_URL, body)
            for name in (body["metadata"]["name"] for body in pools):
                await wait_for_async(f"pool {name} processed ({status_field})",
                                     lambda n=name: ((obj(api, POOLS, n) or {}).get("status") or {}).get(status_field))
            assert operator.ca is not None
            webhook = Webhook(operator.webhook_port, operator.ca)
            await webhook.wait_listening()
            yield Cluster(api, operator, webhook)
        assert_within_rbac(api)  # the operator used only the verbs the chart grants
