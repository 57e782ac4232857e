"""Real AdmissionReview posts over HTTPS to the running operator's webhook.

One emulated cluster (kmock) with four pools and one `kv-offload operator`
process serve the whole module; each test posts its own pods.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kmock
import kubernetes_validate
import pytest
import pytest_asyncio

from operator_harness import (
    KTC,
    POOLS,
    POOLS_URL,
    SIDECAR_IMAGE,
    OperatorProcess,
    assert_within_rbac,
    create,
    emulate_cluster,
    make_tls,
    obj,
    pool_body,
    wait_for,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]
DP_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16",
           "--data-parallel-size", "4", "--kv-transfer-config", KTC]
BAD_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16"]  # no offloading
KUBERNETES_VERSION = "1.33.0"  # native sidecars (initContainers[].restartPolicy) are GA since 1.33
WEBHOOK_PATH = "/inject_sidecar"  # kopf serves each admission handler at /<handler id>


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


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """Apply the response's JSONPatch with an independent RFC 6902 implementation."""
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(pod))


def container(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainers" if init else "containers"
    return next(c for c in pod["spec"].get(key, []) if c["name"] == name)


def mounts_of(c: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c["volumeMounts"]}


@dataclass
class Cluster:
    """The emulated API server, the operator process and a client of its webhook."""

    api: kmock.KubernetesEmulator
    operator: OperatorProcess
    webhook: Webhook


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    tmp_path = tmp_path_factory.mktemp("webhook")
    async with kmock.KubernetesEmulator() as api, kmock.Server(api):
        emulate_cluster(api)
        ca = make_tls(tmp_path / "certs")
        async with OperatorProcess(tmp_path, str(api.url),
                                   extra_args=["--webhook-cert-dir", str(tmp_path / "certs")]) as operator:
            seeded = pool_body("seeded")
            seeded["spec"]["hashSeed"] = "1234"
            for body in (pool_body("llama", sidecar={"capacityBytes": 8 << 30}),
                         pool_body("dp", vllm_args=DP_ARGS), pool_body("broken", vllm_args=BAD_ARGS), seeded):
                await create(api, POOLS_URL, body)
            for name in ("llama", "dp", "broken", "seeded"):
                await wait_for(f"pool {name} processed",
                               lambda: (obj(api, POOLS, name) or {}).get("status", {}).get("conditions"))
            webhook = Webhook(operator.webhook_port, ca)
            await webhook.wait_listening()
            yield Cluster(api, operator, webhook)
        assert_within_rbac(api)  # the operator used only the verbs the chart grants


async def test_a_vllm_pod_gets_a_schema_valid_native_sidecar_and_a_second_admission_adds_nothing(
        cluster: Cluster) -> None:
    pod = vllm_pod(shm_volume=False)
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is True
    result = patched(pod, response)
    kubernetes_validate.validate(result, KUBERNETES_VERSION, strict=True)

    fingerprint = obj(cluster.api, POOLS, "llama")["status"]["fingerprint"]
    assert result["metadata"]["annotations"]["kv-offload.io/injected"] == fingerprint
    copy_tier, sidecar = result["spec"]["initContainers"]
    assert copy_tier["args"] == ["install-tier", "/kv-offload-lib"] and copy_tier["image"] == SIDECAR_IMAGE
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["args"][:1] == ["sidecar"]
    argv = sidecar["args"]
    assert dict(zip(argv[1::2], argv[2::2])) == {
        "--config": "/etc/kv-offload/offloading_config.json",
        "--pool-key-file": "/etc/kv-offload/pool-key/key",
        "--peers-dns": "llama-peers.ns1.svc.cluster.local",
        "--base-port": "5710", "--data-port": "5810", "--capacity-bytes": str(8 << 30),
        "--transport": "ucx", "--dp-indices": "0", "--shm-dir": "/dev/shm"}
    assert [(p["name"], p["containerPort"]) for p in sidecar["ports"]] == [("kvo-metrics", 5710), ("kvo-data", 5810)]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 5710}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 5710}

    volumes = {v["name"]: v for v in result["spec"]["volumes"]}
    assert volumes["kv-offload-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": str((8 << 30) + (1 << 30))}
    sources = volumes["kv-offload-config"]["projected"]["sources"]
    assert sources[0]["configMap"]["name"] == "llama-offloading-config"
    assert sources[1]["secret"]["name"] == "llama-pool-key"

    vllm = container(result, "vllm")
    env = {e["name"]: e for e in vllm["env"]}
    assert env["VLLM_P2P_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"]["value"] == "5710"
    assert env["PYTHONPATH"]["value"] == "/kv-offload-lib"
    assert "HF_TOKEN" in env  # the user's env is kept
    # One pool-wide prefix-hash seed on vLLM and on the sidecar that states it to peers.
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["PYTHONHASHSEED"]["value"] == sidecar_env["PYTHONHASHSEED"] == "0"
    assert sidecar_env["UCX_TLS"] == "tcp,sm,self"
    assert mounts_of(vllm)["/dev/shm"] == mounts_of(sidecar)["/dev/shm"] == "kv-offload-shm"
    assert mounts_of(vllm)["/kv-offload-lib"] == "kv-offload-lib"

    again = await cluster.webhook.admit(result)
    assert again["allowed"] is True
    assert "patch" not in again


async def test_a_data_parallel_pod_gets_one_port_per_global_rank_and_shares_its_own_dev_shm(
        cluster: Cluster) -> None:
    pod = vllm_pod("dp", script="vllm serve meta-llama/Llama-3.1-8B --block-size 16 --data-parallel-size 4 "
                                "--data-parallel-size-local 2 --data-parallel-start-rank 2 "
                                f"--kv-transfer-config '{KTC}'")
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is True
    result = patched(pod, response)
    kubernetes_validate.validate(result, KUBERNETES_VERSION, strict=True)
    sidecar = container(result, "kv-offload-sidecar", init=True)
    assert [(p["name"], p["containerPort"]) for p in sidecar["ports"]] == \
        [("kvo-metrics", 5712), ("kvo-ctrl-3", 5713), ("kvo-data", 5810)]
    assert sidecar["args"][sidecar["args"].index("--dp-indices") + 1] == "2,3"
    # The pod's own /dev/shm volume is shared with the sidecar; no second one is added.
    assert mounts_of(sidecar)["/dev/shm"] == "dshm"
    assert "kv-offload-shm" not in {v["name"] for v in result["spec"]["volumes"]}
    assert [m["mountPath"] for m in container(result, "vllm")["volumeMounts"]].count("/dev/shm") == 1


async def test_a_pod_naming_an_unknown_pool_is_denied_with_a_sentence(cluster: Cluster) -> None:
    response = await cluster.webhook.admit(vllm_pod("no-such-pool"))
    assert response["allowed"] is False
    assert "patch" not in response
    message = response["status"]["message"]
    assert "KVOffloadPool 'no-such-pool' does not exist in namespace 'ns1'" in message
    assert message.endswith(".")


async def test_a_pod_of_an_invalid_pool_is_denied_with_the_translator_message(cluster: Cluster) -> None:
    response = await cluster.webhook.admit(vllm_pod("broken"))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "KVOffloadPool 'broken' in namespace 'ns1' is Invalid" in message
    assert "configure no KV offloading connector" in message


async def test_a_pod_without_the_pool_label_is_left_alone(cluster: Cluster) -> None:
    response = await cluster.webhook.admit(vllm_pod(None))
    assert response["allowed"] is True
    assert "patch" not in response


async def test_a_pod_whose_vllm_args_give_another_fingerprint_is_denied_with_the_field_diff(
        cluster: Cluster) -> None:
    pod = vllm_pod(script=f"vllm serve meta-llama/Llama-3.1-8B --block-size 32 --kv-transfer-config '{KTC}'")
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("The pod cannot join KVOffloadPool 'llama' in namespace 'ns1': ")
    assert "tokens_per_block" in message
    assert "match the pool's spec.vllmArgs" in message


async def test_a_pod_whose_vllm_sets_another_hash_seed_is_denied_saying_to_remove_it_or_set_hash_seed(
        cluster: Cluster) -> None:
    pod = vllm_pod()
    pod["spec"]["containers"][0]["env"].append({"name": "PYTHONHASHSEED", "value": "1234"})
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("The pod cannot join KVOffloadPool 'llama' in namespace 'ns1': ")
    assert "PYTHONHASHSEED='1234'" in message and "spec.hashSeed is '0'" in message
    assert "remove PYTHONHASHSEED from the container" in message and "spec.hashSeed: '1234'" in message
    assert message.endswith(".")

    seeded = vllm_pod("seeded")
    seeded["spec"]["containers"][0]["env"].append({"name": "PYTHONHASHSEED", "value": "1234"})
    response = await cluster.webhook.admit(seeded)
    assert response["allowed"] is True
    result = patched(seeded, response)
    sidecar = container(result, "kv-offload-sidecar", init=True)
    assert [e for e in container(result, "vllm")["env"] if e["name"] == "PYTHONHASHSEED"] == \
        [e for e in sidecar["env"] if e["name"] == "PYTHONHASHSEED"] == [{"name": "PYTHONHASHSEED", "value": "1234"}]


@pytest.mark.asyncio(loop_scope="function")
async def test_without_a_cert_dir_the_webhook_serves_https_with_a_self_signed_certificate(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    async with OperatorProcess(tmp_path, str(kmock.url)) as operator:
        webhook = Webhook(operator.webhook_port, make_tls(tmp_path / "unrelated-ca"))
        await webhook.wait_listening()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await webhook.admit(vllm_pod(None))  # not signed by a CA we trust
        webhook.ssl = ssl.create_default_context()
        webhook.ssl.check_hostname = False
        webhook.ssl.verify_mode = ssl.CERT_NONE
        response = await webhook.admit(vllm_pod(None))
        assert response["allowed"] is True
        assert "self-signed certificate (dev only)" in operator.log()


async def served_certificate(port: int) -> bytes:
    """DER of the certificate the server presents to a new TLS connection."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    try:
        await writer.wait_closed()
    except (ssl.SSLError, ConnectionError):
        pass
    return bytes(der)


def pem_to_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


@pytest.mark.asyncio(loop_scope="function")
async def test_a_renewed_certificate_is_served_without_a_restart_and_a_half_written_pair_is_not(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    certs, renewed = tmp_path / "certs", tmp_path / "renewed"
    old_ca = make_tls(certs)
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=[
            "--webhook-cert-dir", str(certs), "--webhook-cert-check-seconds", "0.2"]) as operator:
        webhook = Webhook(operator.webhook_port, old_ca)
        await webhook.wait_listening()
        assert (await webhook.admit(vllm_pod(None)))["allowed"] is True
        old_der = pem_to_der(certs / "tls.crt")
        assert await served_certificate(operator.webhook_port) == old_der

        # A renewal caught half-way: the new certificate next to the old key.
        new_ca = make_tls(renewed)
        (certs / "tls.crt").write_bytes((renewed / "tls.crt").read_bytes())
        await wait_for("the half-written pair to be noticed", lambda: "not (re)loaded yet" in operator.log(), 30)
        assert await served_certificate(operator.webhook_port) == old_der
        assert operator.proc is not None and operator.proc.returncode is None

        # The key arrives: new connections get the new certificate, from the same process.
        (certs / "tls.key").write_bytes((renewed / "tls.key").read_bytes())
        new_der = pem_to_der(renewed / "tls.crt")
        deadline = time.monotonic() + 30
        while await served_certificate(operator.webhook_port) != new_der:
            assert time.monotonic() < deadline, "the renewed certificate was not served within 30s"
            await asyncio.sleep(0.1)
        assert (await Webhook(operator.webhook_port, new_ca).admit(vllm_pod(None)))["allowed"] is True
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await webhook.admit(vllm_pod(None))  # the old CA no longer vouches for the server
        assert operator.proc.returncode is None and operator.runs == 1
        assert f"sha256:{hashlib.sha256(new_der).hexdigest()}" in operator.log()

