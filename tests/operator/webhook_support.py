"""A client of the running operator's admission webhook, and the pods it is sent."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import ssl
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kubernetes_validate
from operator_harness import KTC

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
                "image": "vllm/vllm-openai:v0.11.0",
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

    async def admit(self, pod: dict[str, Any]) -> dict[str, Any]:
        request = review(pod)
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url, json=request, ssl=self.ssl) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == request["request"]["uid"]
        return answer["response"]

    async def wait_listening(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                await writer.wait_closed()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("the webhook server never listened") from None
                await asyncio.sleep(0.1)


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
