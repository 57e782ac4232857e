"""Real AdmissionReview posts over HTTPS to the running operator's webhook.

One emulated cluster (kmock) with seven pools and one `kv-offload operator`
process serve the whole module; each test posts its own pods.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import pytest_asyncio
from kv_offload_sidecar.engine.sidecar_link import (
    DETACHED_NO_SIDECAR,
    DETACHED_NOT_INJECTED,
    detached_reason,
)
from operator_harness import KTC, LLAMA_ARGS, NAMESPACE, POOLS, POOLS_URL, merge_patch, obj, pool_body
from operator_process import SIDECAR_IMAGE
from waiting import wait_for_async
from webhook_support import SIDECAR_NAME, Cluster, serving_cluster, vllm_pod

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]
DP_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16",
           "--data-parallel-size", "4", "--kv-transfer-config", KTC]
BAD_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16"]  # no offloading
KUBERNETES_VERSION = "1.33.0"  # native sidecars (initContainers[].restartPolicy) are GA since 1.33


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


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    seeded = pool_body("seeded")
    seeded["spec"]["hashSeed"] = "1234"
    pools = (pool_body("llama", sidecar={"capacityBytes": 8 << 30}),
             pool_body("dp", vllm_args=DP_ARGS), pool_body("broken", vllm_args=BAD_ARGS), seeded,
             pool_body("tls", sidecar={"transport": "tcp", "tls": {"secretName": "tls-pool-cert"}}),
             pool_body("tls-ucx", sidecar={"dataPlane": {"transport": "ucx"}, "tls": {"secretName": "tls-pool-cert"}}),
             pool_body("revised", vllm_args=[*LLAMA_ARGS, "--revision", "abc123"]),
             pool_body("doomed", sidecar={"dataPlane": {"transport": "tcp"}, "tls": {"secretName": "tls-pool-cert"}}))
    async with serving_cluster(tmp_path_factory.mktemp("webhook"), pools, status_field="conditions") as c:
        yield c


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
        "--pool-key-file": "/etc/kv-offload-pool-key/key",
        "--previous-pool-key-file": "/etc/kv-offload-pool-key/previous-key",
        "--admin-token-file": "/etc/kv-offload-pool-key/admin-token",
        "--peers-dns": "llama-peers.ns1.svc",
        "--base-port": "5710", "--data-port": "5810", "--capacity-bytes": str(8 << 30),
        # A GPU pod of a pool that names no data plane: tcp, the plane measured on a GPU, a lane per core.
        "--transport": "tcp", "--prefill-tokens-per-second": "0", "--peer-copies": "drop",
        "--dp-indices": "0", "--shm-dir": "/dev/shm",
        "--engine-metrics-url": "http://127.0.0.1:8000/metrics"}  # its vLLM's own (pod_defaults)
    assert [(p["name"], p["containerPort"]) for p in sidecar["ports"]] == [("kvo-metrics", 5710), ("kvo-data", 5810)]
    # No readinessProbe: the sidecar never takes the vLLM replica out of its Service.
    assert "readinessProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 5710}

    volumes = {v["name"]: v for v in result["spec"]["volumes"]}
    # /dev/shm holds the 8 GiB store, vLLM's 10 GiB primary tier (cpu_bytes_to_use) and 1 GiB head room.
    assert volumes["kv-offload-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "19Gi"}
    assert sidecar["resources"]["requests"]["memory"] == "8448Mi"  # the store + 256 MiB
    sources = volumes["kv-offload-config"]["projected"]["sources"]
    assert [s["configMap"]["name"] for s in sources] == ["llama-offloading-config"]
    # Whole, no items; optional: a deleted pool blocks no container restart.
    assert volumes["kv-offload-pool-key"]["secret"] == {"secretName": "llama-pool-key", "optional": True}
    assert mounts_of(sidecar)["/etc/kv-offload-pool-key"] == "kv-offload-pool-key"

    vllm = container(result, "vllm")
    env = {e["name"]: e for e in vllm["env"]}
    assert env["VLLM_P2P_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"]["value"] == "5710"
    assert env["PYTHONPATH"]["value"] == "/kv-offload-lib"
    assert "HF_TOKEN" in env  # the user's env is kept
    # One pool-wide prefix-hash seed on vLLM and on the sidecar that states it to peers: the
    # pool's secret seed (no spec.hashSeed), which the kubelet reads from the pool Secret.
    sidecar_env = {e["name"]: e for e in sidecar["env"]}
    seed_ref = {"secretKeyRef": {"name": "llama-pool-key", "key": "hash-seed", "optional": True}}
    assert env["PYTHONHASHSEED"] == sidecar_env["PYTHONHASHSEED"] == {"name": "PYTHONHASHSEED",
                                                                     "valueFrom": seed_ref}
    secret = obj(cluster.api, "v1/secrets", "llama-pool-key")
    assert base64.b64decode(secret["data"]["hash-seed"]).isdigit()
    assert "UCX_TLS" not in sidecar_env  # tcp beside the GPU: no UCX to configure
    # Its CPU request (the downward API), the CPU budget of its threads where no limit is set.
    assert sidecar_env["KV_OFFLOAD_CPU_REQUEST_MILLICORES"]["valueFrom"] == {"resourceFieldRef": {
        "containerName": "kv-offload-sidecar", "resource": "requests.cpu", "divisor": "1m"}}
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


@pytest.mark.parametrize(("pool", "why"), [
    ("broken", "configure no KV offloading connector"),
    ("tls-ucx", "TLS applies to the tcp transport only and UCX traffic is not encrypted"),
], ids=["without-an-offloading-connector", "tls-on-ucx-which-is-not-encrypted"])
async def test_a_pod_of_an_invalid_pool_is_denied_with_the_translators_reason(
        cluster: Cluster, pool: str, why: str) -> None:
    response = await cluster.webhook.admit(vllm_pod(pool))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert f"KVOffloadPool '{pool}' in namespace 'ns1' is Invalid" in message
    assert why in message


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


def revised_pod(revision: str) -> dict[str, Any]:
    return vllm_pod("revised", script=(
        f"vllm serve meta-llama/Llama-3.1-8B --port 8000 --block-size 16 --revision {revision} "
        f"--kv-transfer-config '{KTC}'"))


async def test_a_pod_whose_vllm_args_declare_another_revision_is_denied_with_the_declared_field_diff(
        cluster: Cluster) -> None:
    assert obj(cluster.api, POOLS, "revised")["status"]["declaredModelIdentity"] == \
        '{"block_size":"16","revision":"abc123"}'
    response = await cluster.webhook.admit(revised_pod("def456"))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("The pod cannot join KVOffloadPool 'revised' in namespace 'ns1': ")
    assert 'model_identity.revision: "abc123" != "def456"' in message
    response = await cluster.webhook.admit(revised_pod("abc123"))
    assert response["allowed"] is True, response


async def test_a_pool_whose_status_still_declares_another_identity_asks_pods_to_retry(
        cluster: Cluster) -> None:
    url = f"{POOLS_URL}/revised"
    shown = obj(cluster.api, POOLS, "revised")["status"]["declaredModelIdentity"]

    async def refused(pod: dict[str, Any]) -> dict[str, Any] | None:
        answer = await cluster.webhook.admit(pod)
        return None if answer["allowed"] else answer

    await merge_patch(cluster.api, url, {"status": {"declaredModelIdentity": '{"revision":"old"}'}})
    try:  # until the operator's watch shows the patched status (it may admit from the pool as last watched)
        response = await wait_for_async("the webhook seeing the patched status", lambda: refused(revised_pod("abc123")))
    finally:
        await merge_patch(cluster.api, url, {"status": {"declaredModelIdentity": shown}})
    assert response["allowed"] is False
    assert response["status"]["code"] == 503
    assert "is being updated (its spec declares model identity" in response["status"]["message"]


async def test_a_pod_whose_vllm_sets_another_hash_seed_is_denied_saying_to_remove_it_or_set_hash_seed(
        cluster: Cluster) -> None:
    pod = vllm_pod("seeded")
    pod["spec"]["containers"][0]["env"].append({"name": "PYTHONHASHSEED", "value": "7"})
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("The pod cannot join KVOffloadPool 'seeded' in namespace 'ns1': ")
    assert "PYTHONHASHSEED='7'" in message and "spec.hashSeed is '1234'" in message
    assert "remove PYTHONHASHSEED from the container" in message and "spec.hashSeed: '7'" in message
    assert message.endswith(".")

    # A pool without spec.hashSeed uses its secret seed: the container may set none at all.
    secret_seeded = vllm_pod()
    secret_seeded["spec"]["containers"][0]["env"].append({"name": "PYTHONHASHSEED", "value": "1234"})
    response = await cluster.webhook.admit(secret_seeded)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("The pod cannot join KVOffloadPool 'llama' in namespace 'ns1': the vLLM container "
                              "sets PYTHONHASHSEED='1234' but the pool has no spec.hashSeed")
    assert "remove PYTHONHASHSEED from the container, or set spec.hashSeed on the pool" in message

    seeded = vllm_pod("seeded")
    seeded["spec"]["containers"][0]["env"].append({"name": "PYTHONHASHSEED", "value": "1234"})
    response = await cluster.webhook.admit(seeded)
    assert response["allowed"] is True
    result = patched(seeded, response)
    sidecar = container(result, "kv-offload-sidecar", init=True)
    assert [e for e in container(result, "vllm")["env"] if e["name"] == "PYTHONHASHSEED"] == \
        [e for e in sidecar["env"] if e["name"] == "PYTHONHASHSEED"] == [{"name": "PYTHONHASHSEED", "value": "1234"}]


async def test_a_tls_pod_gets_the_certificate_secret_mounted_and_the_tls_flags(cluster: Cluster) -> None:
    pod = vllm_pod("tls")
    response = await cluster.webhook.admit(pod)
    assert response["allowed"] is True, response.get("status")
    result = patched(pod, response)
    kubernetes_validate.validate(result, KUBERNETES_VERSION, strict=True)
    sidecar = container(result, "kv-offload-sidecar", init=True)
    argv = sidecar["args"]
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert flags["--transport"] == "tcp"
    assert (flags["--tls-cert-file"], flags["--tls-key-file"], flags["--tls-ca-file"]) == (
        "/etc/kv-offload-tls/tls.crt", "/etc/kv-offload-tls/tls.key", "/etc/kv-offload-tls/ca.crt")
    volumes = {v["name"]: v for v in result["spec"]["volumes"]}
    assert volumes["kv-offload-tls"]["secret"] == {"secretName": "tls-pool-cert", "optional": True}
    assert mounts_of(sidecar)["/etc/kv-offload-tls"] == "kv-offload-tls"




def container_blockers(pod: dict[str, Any], present: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (kind, name) of every absent ConfigMap or Secret that keeps the kubelet from
    (re)starting one of ``pod``'s containers: a volume, projected source, env valueFrom or
    envFrom naming it without ``optional: true`` (ContainerCreating, CreateContainerConfigError)."""
    refs: list[tuple[str, str, bool]] = []
    for vol in pod["spec"].get("volumes", []):
        sources = [vol] + list((vol.get("projected") or {}).get("sources", []))
        for src in sources:
            if "configMap" in src:
                refs.append(("ConfigMap", src["configMap"]["name"], bool(src["configMap"].get("optional"))))
            if "secret" in src:
                ref = src["secret"]
                refs.append(("Secret", ref.get("secretName") or ref.get("name"), bool(ref.get("optional"))))
    for c in pod["spec"].get("containers", []) + pod["spec"].get("initContainers", []):
        for e in c.get("env", []):
            for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                ref = (e.get("valueFrom") or {}).get(key)
                if ref:
                    refs.append((kind, ref["name"], bool(ref.get("optional"))))
        for e in c.get("envFrom", []):
            for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                if key in e:
                    refs.append((kind, e[key]["name"], bool(e[key].get("optional"))))
    return {(kind, name) for kind, name, optional in refs if not optional and (kind, name) not in present}


def present_objects(cluster: Cluster) -> set[tuple[str, str]]:
    return {(o.raw.get("kind"), o.raw["metadata"]["name"]) for o in cluster.api.objects.values()
            if not o.deleted and o.raw.get("kind") in ("ConfigMap", "Secret")}


def owned_by(cluster: Cluster, pool: str) -> list[tuple[str, str]]:
    return [(o.raw["kind"], o.raw["metadata"]["name"]) for o in cluster.api.objects.values()
            if not o.deleted and o.raw.get("kind") in ("ConfigMap", "Secret")
            and any(r.get("name") == pool for r in o.raw["metadata"].get("ownerReferences", []))]


async def test_deleting_a_pool_leaves_its_running_pods_able_to_restart_every_container(
        cluster: Cluster) -> None:
    pod = vllm_pod("doomed")
    result = patched(pod, await cluster.webhook.admit(pod))
    owned = owned_by(cluster, "doomed")
    assert {kind for kind, _ in owned} == {"ConfigMap", "Secret"}
    user_secret = {("Secret", "hf-token")}  # the pod's own, never created in this cluster
    # While the pool lives, nothing of kv-offload's blocks a container; the TLS Secret is the user's.
    assert container_blockers(result, present_objects(cluster) | {("Secret", "tls-pool-cert")}) == user_secret
    resp = await cluster.api.delete(f"{POOLS_URL}/doomed")
    assert resp.status == 200, await resp.text()
    await wait_for_async("the pool gone", lambda: obj(cluster.api, POOLS, "doomed") is None)
    for kind, name in owned:  # the garbage collection the emulator does not run
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        resp = await cluster.api.delete(f"/api/v1/namespaces/{NAMESPACE}/{plural}/{name}")
        assert resp.status == 200, await resp.text()
    # Pool, ConfigMap, Secret and even the TLS Secret gone: every container still (re)starts.
    assert not set(owned) & present_objects(cluster)
    assert container_blockers(result, present_objects(cluster)) == user_secret
    # Before this change the seed's secretKeyRef and the config / key volumes blocked them.
    assert container_blockers(strip_optional(result), present_objects(cluster)) > user_secret


def strip_optional(pod: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(pod).replace(', "optional": true', "").replace('"optional": true, ', "")
    return json.loads(text)


async def test_a_sidecar_that_never_answers_does_not_keep_vllm_from_starting(cluster: Cluster) -> None:
    pod = vllm_pod()
    result = patched(pod, await cluster.webhook.admit(pod))
    sidecar = container(result, SIDECAR_NAME, init=True)
    # The kubelet starts the next container once a native sidecar without a startupProbe runs.
    assert sidecar["restartPolicy"] == "Always" and "startupProbe" not in sidecar
    # The liveness probe waits out the store's pre-fault (a minute plus a second per GiB).
    assert sidecar["livenessProbe"]["initialDelaySeconds"] == 60 + 8


async def test_a_pod_created_through_an_escape_hatch_names_the_tier_and_its_tier_runs_not_injected(
        cluster: Cluster) -> None:
    """The chart README's escape hatches: the label dropped (the webhook leaves the pod alone) or
    the webhook down under ``failurePolicy: Ignore`` (the API server creates the pod as sent).
    Either way vLLM's command line still names the tier and its environment has none of what
    the webhook injects: the tier reads that as ``not_injected`` and runs detached (the real
    engine doing so: tests/vllm/test_real_vllm_engines.py); an injected pod's tier never does."""
    ktc = json.loads(KTC)
    ktc["kv_connector_extra_config"].update(spec_name="TieringOffloadingSpec", secondary_tiers=[
        {"type": "KVOffloadSecondaryTier", "module_path": "kv_offload_sidecar.engine.vllm_tier"}])
    script = ("vllm serve meta-llama/Llama-3.1-8B --port 8000 --block-size 16 "
              f"--gpu-memory-utilization 0.9 --kv-transfer-config '{json.dumps(ktc)}'")
    unlabelled = vllm_pod(None, script=script)
    assert "patch" not in await cluster.webhook.admit(unlabelled)
    as_sent = vllm_pod("llama", script=script)  # what failurePolicy Ignore creates, webhook down
    injected = patched(as_sent, await cluster.webhook.admit(as_sent))
    gone = ConnectionRefusedError("nothing listens")
    for pod, reason in ((unlabelled, DETACHED_NOT_INJECTED), (as_sent, DETACHED_NOT_INJECTED),
                        (injected, DETACHED_NO_SIDECAR)):
        vllm = container(pod, "vllm")
        assert "kv_offload_sidecar.engine.vllm_tier" in " ".join(vllm["args"])
        env = {e["name"]: e.get("value", "(from the API)") for e in vllm.get("env", [])}
        failure = OSError("cannot reach the kv-offload sidecar")
        failure.__context__ = gone  # as EngineClient.connect reports it (raise ... from None)
        assert detached_reason(failure, environ=env) == reason
