"""kopf's real runtime runs `kv-offload operator` against kmock's KubernetesEmulator over HTTP."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from aiohttp import web
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_testing.local_pool import LocalPool, SidecarOverride
from operator_harness import (
    KTC,
    LLAMA_ARGS,
    NAMESPACE,
    POOLS,
    POOLS_URL,
    assert_within_rbac,
    create,
    emulate_cluster,
    llama_config,
    merge_patch,
    obj,
    pool_body,
    requests_to,
)
from metrics_support import value, wait_for_metrics
from operator_process import KV_OFFLOAD, SIDECAR_IMAGE, OperatorProcess, free_ports
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler
from waiting import wait_for_async

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def operator_stays_within_its_rbac(kmock: kmock.KubernetesEmulator) -> Iterator[None]:
    """After each scenario: the operator used only the verbs the chart grants."""
    yield
    assert_within_rbac(kmock)


def cli_translate(tmp_path: Path, vllm_args: list[str],
                  model_config: dict[str, Any] | None = None) -> tuple[int, str, str]:
    """Run the real `kv-offload translate` CLI (Llama-3.1-8B's config.json unless
    ``model_config``); returns (exit code, stdout, stderr)."""
    model = tmp_path / "config.json"
    model.write_text(json.dumps(model_config or llama_config()))
    done = subprocess.run(
        [KV_OFFLOAD, "translate", "--model-config", str(model),
         "--vllm-args", shlex.join(vllm_args)], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def cli_fingerprint(tmp_path: Path, vllm_args: list[str],
                    model_config: dict[str, Any] | None = None) -> str:
    code, out, err = cli_translate(tmp_path, vllm_args, model_config)
    assert code == 0, err
    return OffloadingConfig.from_json(out).fingerprint


def status_of(k: kmock.KubernetesEmulator, name: str) -> dict[str, Any]:
    return (obj(k, POOLS, name) or {}).get("status") or {}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


async def test_creating_a_pool_writes_configmap_secret_service_and_the_cli_fingerprint(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    expected = cli_fingerprint(tmp_path, LLAMA_ARGS)
    async with OperatorProcess(tmp_path, str(kmock.url)) as operator:
        await create(kmock, POOLS_URL, pool_body("llama"))
        status = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{operator.health_port}/healthz") as resp:
                assert resp.status == 200

        st = status_of(kmock, "llama")
        assert status == expected
        assert st["namespaceDigest"] == expected[:12]
        assert st["configMap"] == "llama-offloading-config"
        assert st["observedGeneration"] == 1
        assert st["readyPeers"] == 0
        assert condition(st, "Ready")["status"] == "True"
        assert condition(st, "Invalid")["status"] == "False"

        cm = obj(kmock, "v1/configmaps", "llama-offloading-config")
        assert cm is not None
        config = OffloadingConfig.from_json(cm["data"]["offloading_config.json"])
        assert config.fingerprint == expected
        owner = cm["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == \
            ("KVOffloadPool", "llama", "uid-llama", True)

        secret = obj(kmock, "v1/secrets", "llama-pool-key")
        assert secret is not None
        assert len(base64.b64decode(secret["data"]["key"])) == 32

        svc = obj(kmock, "v1/services", "llama-peers")
        assert svc is not None
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"kv-offload.io/pool": "llama"}
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"kvo-ctrl-0": 5710, "kvo-data": 5810}


async def test_an_update_changes_fingerprint_configmap_and_service_but_never_the_pool_key(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    new_args = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "32",
                "--data-parallel-size", "2", "--kv-transfer-config", KTC]
    old_fp, new_fp = cli_fingerprint(tmp_path, LLAMA_ARGS), cli_fingerprint(tmp_path, new_args)
    assert old_fp != new_fp
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, pool_body("llama"))
        await wait_for_async("the first fingerprint", lambda: status_of(kmock, "llama").get("fingerprint") == old_fp)
        key_before = obj(kmock, "v1/secrets", "llama-pool-key")["data"]["key"]

        await merge_patch(kmock, f"{POOLS_URL}/llama",
                          {"metadata": {"generation": 2}, "spec": {"vllmArgs": new_args}})
        await wait_for_async("the new fingerprint", lambda: status_of(kmock, "llama").get("fingerprint") == new_fp)

        st = status_of(kmock, "llama")
        assert st["observedGeneration"] == 2
        cm = obj(kmock, "v1/configmaps", "llama-offloading-config")
        assert OffloadingConfig.from_json(cm["data"]["offloading_config.json"]).fingerprint == new_fp
        svc = obj(kmock, "v1/services", "llama-peers")
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == \
            {"kvo-ctrl-0": 5710, "kvo-ctrl-1": 5711, "kvo-data": 5810}
        assert obj(kmock, "v1/secrets", "llama-pool-key")["data"]["key"] == key_before


async def test_a_changed_revision_rewrites_the_declared_model_identity_under_the_same_fingerprint(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    """Issue 47: --revision leaves vLLM's fingerprint alone; the pool's ConfigMap and status
    carry it as the declared model identity, and a new revision replaces it."""
    emulate_cluster(kmock)

    def declared() -> dict[str, str]:
        cm = obj(kmock, "v1/configmaps", "llama-offloading-config") or {"data": {}}
        return json.loads(cm["data"].get("offloading_config.json") or "{}").get("model_identity", {})

    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, pool_body("llama", vllm_args=[*LLAMA_ARGS, "--revision", "abc123"]))
        fp = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
        assert declared() == {"revision": "abc123", "block_size": "16"}
        assert status_of(kmock, "llama")["declaredModelIdentity"] == '{"block_size":"16","revision":"abc123"}'

        await merge_patch(kmock, f"{POOLS_URL}/llama", {"metadata": {"generation": 2},
                                                        "spec": {"vllmArgs": LLAMA_ARGS}})
        await wait_for_async("the revision gone", lambda: status_of(kmock, "llama").get(
            "declaredModelIdentity") == '{"block_size":"16"}')
        assert declared() == {"block_size": "16"}
        assert status_of(kmock, "llama")["fingerprint"] == fp


async def test_a_data_parallel_pools_configmap_holds_no_engines_own_values(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    """Every pod of the pool mounts the one ConfigMap, so it carries no engine's DP index or
    engine id suffix; its fingerprint is every engine's (each pod's DP ranks come from the pod)."""
    emulate_cluster(kmock)
    ktc = json.loads(KTC)
    ktc["engine_id"] = "llama-pool"
    dp_args = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16", "-dp", "4", "-dpl", "2",
               "-dpr", "2", "--kv-transfer-config", json.dumps(ktc)]
    code, out, err = cli_translate(tmp_path, dp_args)
    assert code == 0, err
    engine = OffloadingConfig.from_json(out)  # what the CLI gives for this line's first engine
    assert (engine.engine_id, engine.parallel.data_parallel_index) == ("llama-pool_dp2", 2)
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, pool_body("dp", vllm_args=dp_args))
        fingerprint = await wait_for_async("the pool status", lambda: status_of(kmock, "dp").get("fingerprint"))
        cm = obj(kmock, "v1/configmaps", "dp-offloading-config")
        config = OffloadingConfig.from_json(cm["data"]["offloading_config.json"])
        assert fingerprint == config.fingerprint == engine.fingerprint
        assert config.engine_id == "llama-pool"
        assert config.parallel.data_parallel_index == 0
        assert config.parallel.data_parallel_rank_local is None
        assert config.parallel.rank == 0 and config.parallel.data_parallel_size == 4
        svc = obj(kmock, "v1/services", "dp-peers")
        assert {p["name"] for p in svc["spec"]["ports"]} == \
            {"kvo-ctrl-0", "kvo-ctrl-1", "kvo-ctrl-2", "kvo-ctrl-3", "kvo-data"}


async def test_an_invalid_spec_sets_the_invalid_condition_with_the_translator_message_and_keeps_the_configmap(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    bad_args = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16"]  # no offloading
    code, out, err = cli_translate(tmp_path, bad_args)
    assert code == 2 and out == ""
    translator_message = err.strip()
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, pool_body("llama"))
        good_fp = await wait_for_async("the good fingerprint", lambda: status_of(kmock, "llama").get("fingerprint"))
        good_cm = obj(kmock, "v1/configmaps", "llama-offloading-config")

        await merge_patch(kmock, f"{POOLS_URL}/llama",
                          {"metadata": {"generation": 2}, "spec": {"vllmArgs": bad_args}})
        invalid = await wait_for_async("the Invalid condition",
                                       lambda: condition(status_of(kmock, "llama"), "Invalid").get("status") == "True"
                                       and condition(status_of(kmock, "llama"), "Invalid"))

        assert invalid["message"] in translator_message  # the CLI may prefix its own name
        assert invalid["message"].startswith("the vLLM args configure no KV offloading connector")
        st = status_of(kmock, "llama")
        assert condition(st, "Ready")["status"] == "False"
        assert st["observedGeneration"] == 2
        assert st["fingerprint"] == good_fp  # the last good config is still what pods use
        assert obj(kmock, "v1/configmaps", "llama-offloading-config") == good_cm

        # A pool that is invalid from the start gets the condition and no children at all.
        await create(kmock, POOLS_URL, pool_body("broken", vllm_args=bad_args))
        await wait_for_async("the broken pool's Invalid condition",
                             lambda: condition(status_of(kmock, "broken"), "Invalid").get("status") == "True")
        assert condition(status_of(kmock, "broken"), "Invalid")["message"] == invalid["message"]
        assert "fingerprint" not in status_of(kmock, "broken")
        for resource, name in (("v1/configmaps", "broken-offloading-config"),
                               ("v1/secrets", "broken-pool-key"), ("v1/services", "broken-peers")):
            assert obj(kmock, resource, name) is None


async def test_restarting_the_operator_midway_creates_no_duplicates_and_keeps_the_pool_key(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    operator = OperatorProcess(tmp_path, str(kmock.url))
    await operator.start()
    try:
        await create(kmock, POOLS_URL, pool_body("first"))
        await wait_for_async("the first pool", lambda: status_of(kmock, "first").get("fingerprint"))
        key = obj(kmock, "v1/secrets", "first-pool-key")["data"]["key"]
        await operator.stop(signal.SIGKILL)  # a crash, not a clean shutdown

        await create(kmock, POOLS_URL, pool_body("second"))  # arrives while the operator is down
        await operator.start()
        await wait_for_async("the second pool", lambda: status_of(kmock, "second").get("fingerprint"))
        await wait_for_async("the resumed first pool",
                             lambda: f"Pool {NAMESPACE}/first: fingerprint" in operator.log())
    finally:
        await operator.stop()

    assert obj(kmock, "v1/secrets", "first-pool-key")["data"]["key"] == key
    creations = [(r.resource.plural, (r.data or {}).get("metadata", {}).get("name"))
                 for r in requests_to(kmock, "POST") if r.resource is not None]
    children = [c for c in creations if c[0] in ("configmaps", "secrets", "services")]
    assert sorted(children) == sorted(set(children))  # each child created exactly once
    assert {name for _, name in children} == {
        "first-offloading-config", "first-pool-key", "first-peers",
        "second-offloading-config", "second-pool-key", "second-peers"}


def sidecar_pod(name: str, port: int, fingerprint: str | None, *, sidecar: str = "running", pool: str = "llama",
                ip: str | None = "127.0.0.1") -> dict[str, Any]:
    """A pool pod as the webhook leaves it and the kubelet reports it: its native sidecar declares
    ``kvo-metrics`` = ``port`` and runs (or waits, restarting) at ``ip``; vLLM is not Ready yet."""
    state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if sidecar == "running" else \
        {"waiting": {"reason": "CrashLoopBackOff"}}
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}",
                            "labels": {"kv-offload.io/pool": pool}}
    if fingerprint is not None:
        meta["annotations"] = {"kv-offload.io/injected": fingerprint}
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "False"}],  # vLLM still loading its model
        "initContainerStatuses": [{"name": "kv-offload-sidecar", "ready": sidecar == "running",
                                   "started": sidecar == "running", "state": state}]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"initContainers": [{"name": "kv-offload-sidecar", "image": SIDECAR_IMAGE,
                                         "restartPolicy": "Always",
                                         "ports": [{"name": "kvo-metrics", "containerPort": port},
                                                   {"name": "kvo-data", "containerPort": 5810}]}],
                     "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.34.0"}]},
            "status": status}


async def test_ready_peers_counts_the_sidecars_that_report_a_connected_peer_on_their_metrics_port(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    """READY PEERS: the pool's running sidecars whose own /metrics shows the pool's current
    fingerprint and kv_offload_peers{state="connected"} >= 1. Real sidecar processes, run with
    the pool's ConfigMap, answer for the emulated pods: three share the pool key and connect, a
    fourth has another key (every handshake rejected); a killed sidecar does not answer."""
    emulate_cluster(kmock)
    pods_url = f"/api/v1/namespaces/{NAMESPACE}/pods"
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--ready-peers-check-seconds", "0.3"]):
        await create(kmock, POOLS_URL, pool_body("llama"))
        fp = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
        assert status_of(kmock, "llama")["readyPeers"] == 0
        cm = obj(kmock, "v1/configmaps", "llama-offloading-config")
        assert cm is not None
        config = OffloadingConfig.from_json(cm["data"]["offloading_config.json"])
        sidecars = LocalPool(4, config=config, overrides={3: SidecarOverride(pool_key=b"another-pool-key")})
        foreign = LocalPool(2)  # another pool's sidecars (another config), connected to each other
        try:
            await asyncio.gather(asyncio.to_thread(sidecars.start), asyncio.to_thread(foreign.start))
            for i in range(4):
                await create(kmock, pods_url, sidecar_pod(f"p{i}", sidecars[i].port, fp))
            # Not asked, though each points at a connected sidecar of the pool: its sidecar restarts,
            # it was not injected, or it belongs to another pool.
            connected = sidecars[1].port
            await create(kmock, pods_url, sidecar_pod("restarting", connected, fp, sidecar="waiting"))
            await create(kmock, pods_url, sidecar_pod("plain", connected, None))
            await create(kmock, pods_url, sidecar_pod("other", connected, fp, pool="elsewhere"))
            # Asked and answered, not counted: another pool's sidecar at the pod's (reused) address.
            await create(kmock, pods_url, sidecar_pod("reused-ip", foreign[0].port, fp))
            await create(kmock, pods_url, sidecar_pod("no-ip-yet", connected, fp, ip=None))  # cannot answer

            def shows(ready: int, unanswered: int, connected_sessions: int) -> bool:
                st = status_of(kmock, "llama")
                return (st.get("readyPeers"), st.get("unansweredSidecars"),
                        (st.get("peerStates") or {}).get("connected")) == (ready, unanswered, connected_sessions)

            # p0..p2 each connected to the two others; p3 rejected by all (and rejecting them).
            await wait_for_async("three ready peers", lambda: shows(3, 1, 6))
            states = status_of(kmock, "llama")["peerStates"]
            assert set(states) == {"connected", "connecting", "backoff", "rejected"}
            assert states["rejected"] + states["backoff"] + states["connecting"] >= 3, states
            assert (await asyncio.to_thread(sidecars[3].metric, "kv_offload_peers", state="connected")) == 0
            assert (await asyncio.to_thread(foreign[0].metric, "kv_offload_peers", state="connected")) == 1

            # A sidecar dies (its pod's status still says running): it no longer answers.
            await asyncio.to_thread(sidecars[0].kill)
            await wait_for_async("two ready peers", lambda: shows(2, 2, 2))

            # The pod that had no IP gets one (it reaches sidecar 1).
            await merge_patch(kmock, f"{pods_url}/no-ip-yet", {"status": {"podIP": "127.0.0.1"}})
            await wait_for_async("the late pod counted", lambda: shows(3, 1, 3))
            # A spec change: every sidecar still runs the old fingerprint.
            new_args = [*LLAMA_ARGS[:4], "32", *LLAMA_ARGS[5:]]  # --block-size 32: another fingerprint
            await merge_patch(kmock, f"{POOLS_URL}/llama",
                              {"metadata": {"generation": 2}, "spec": {"vllmArgs": new_args}})
            await wait_for_async("no ready peer of the new fingerprint",
                                 lambda: status_of(kmock, "llama").get("fingerprint") != fp and shows(0, 1, 0))
        finally:
            await asyncio.gather(asyncio.to_thread(sidecars.stop), asyncio.to_thread(foreign.stop))
    # Written on change only: never the same count twice in a row (checks ran every 0.3 s).
    counts = [r.data["status"] for r in requests_to(kmock, "PATCH") if r.subresource == "status"
              and "peerStates" in ((r.data or {}).get("status") or {})]
    assert len(counts) >= 4 and all(a != b for a, b in itertools.pairwise(counts)), counts


async def serve_sidecar_metrics(fingerprint: str, model_identity: str, port: int) -> web.AppRunner:
    """A pod's kvo-metrics port answering what a sidecar of ``model_identity`` exports (the
    sidecar's own SidecarMetrics, one connected peer) on 127.0.0.1:``port``."""
    metrics = SidecarMetrics(CollectorRegistry())
    metrics.peers.labels(state="connected").set(1)
    metrics.set_config_info(fingerprint=fingerprint, transport="tcp", model_identity=model_identity)
    app = web.Application()
    app.router.add_get("/metrics", make_aiohttp_handler(registry=metrics.registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_a_rolling_update_to_other_weights_shows_each_model_identity_with_its_pods(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    """status.modelIdentities counts the pool's sidecars by the model identity their engines
    attached with: old and new weights under one fingerprint while a rollout runs, then one."""
    emulate_cluster(kmock)
    pods_url = f"/api/v1/namespaces/{NAMESPACE}/pods"
    old, new = "0a" * 8, "0b" * 8
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--ready-peers-check-seconds", "0.3"]) \
            as operator:
        await create(kmock, POOLS_URL, pool_body("llama"))
        fp = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
        pods = {"old-0": old, "old-1": old, "old-2": old, "new-0": new, "new-1": ""}  # new-1 still loading
        ports = dict(zip(pods, free_ports(len(pods))))
        runners = [await serve_sidecar_metrics(fp, identity, ports[name]) for name, identity in pods.items()]
        try:
            for name, port in ports.items():
                await create(kmock, pods_url, sidecar_pod(name, port, fp))

            def identities() -> list[dict[str, Any]] | None:
                return status_of(kmock, "llama").get("modelIdentities")

            midway = [{"identity": old, "pods": 3}, {"identity": "", "pods": 1}, {"identity": new, "pods": 1}]
            await wait_for_async("both identities with their pods", lambda: identities() == midway)
            mixed = "kv_offload_operator_pools_with_mixed_model_identities"
            await wait_for_metrics(operator.metrics_port, lambda m: value(m, mixed) == 1)

            for name in ("old-0", "old-1", "old-2"):  # the rollout replaces the old pods
                assert (await kmock.delete(f"{pods_url}/{name}")).status == 200
            done = [{"identity": "", "pods": 1}, {"identity": new, "pods": 1}]
            await wait_for_async("the new identity alone", lambda: identities() == done)
            await wait_for_metrics(operator.metrics_port, lambda m: value(m, mixed) == 0)
        finally:
            for runner in runners:
                await runner.cleanup()


async def test_model_config_ref_reads_the_model_config_from_a_configmap(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    expected = cli_fingerprint(tmp_path, LLAMA_ARGS)
    await create(kmock, f"/api/v1/namespaces/{NAMESPACE}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llama-model", "namespace": NAMESPACE},
        "data": {"config.json": json.dumps(llama_config())}})
    body = pool_body("llama")
    del body["spec"]["modelConfig"]
    body["spec"]["modelConfigRef"] = {"name": "llama-model", "key": "config.json"}
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, body)
        fingerprint = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
    assert fingerprint == expected


async def test_an_edited_model_config_map_is_translated_again_without_a_spec_change(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    model_url = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    narrower = dict(llama_config(), num_hidden_layers=16)  # other layer names: another fingerprint
    before = cli_fingerprint(tmp_path, LLAMA_ARGS)
    after = cli_fingerprint(tmp_path, LLAMA_ARGS, narrower)
    assert before != after
    await create(kmock, model_url, {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llama-model", "namespace": NAMESPACE},
        "data": {"config.json": json.dumps(llama_config())}})
    body = pool_body("llama")
    del body["spec"]["modelConfig"]
    body["spec"]["modelConfigRef"] = {"name": "llama-model"}

    def pool_config() -> OffloadingConfig:
        cm = obj(kmock, "v1/configmaps", "llama-offloading-config")
        return OffloadingConfig.from_json(cm["data"]["offloading_config.json"])

    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--model-config-check-seconds", "0.3"]):
        await create(kmock, POOLS_URL, body)
        await wait_for_async("the first fingerprint", lambda: status_of(kmock, "llama").get("fingerprint") == before)
        first_digest = status_of(kmock, "llama")["modelConfigDigest"]

        await merge_patch(kmock, f"{model_url}/llama-model", {"data": {"config.json": json.dumps(narrower)}})
        await wait_for_async("the edited model's fingerprint",
                             lambda: status_of(kmock, "llama").get("fingerprint") == after)
        assert pool_config().fingerprint == after
        assert status_of(kmock, "llama")["modelConfigDigest"] != first_digest
        assert status_of(kmock, "llama")["observedGeneration"] == 1  # the spec did not change

        # A broken edit says what is wrong and leaves the pool on its last good translation.
        await merge_patch(kmock, f"{model_url}/llama-model", {"data": {"config.json": "{not json"}})
        invalid = await wait_for_async("the Invalid condition",
                                       lambda: condition(status_of(kmock, "llama"), "Invalid").get("status") == "True"
                                       and condition(status_of(kmock, "llama"), "Invalid"))
        assert invalid["message"].startswith("ConfigMap 'llama-model' key 'config.json' is not JSON")
        assert pool_config().fingerprint == after
        assert status_of(kmock, "llama")["fingerprint"] == after

        # Fixing it makes the pool Ready again with the fixed config.
        await merge_patch(kmock, f"{model_url}/llama-model", {"data": {"config.json": json.dumps(llama_config())}})
        await wait_for_async("Ready with the original fingerprint again",
                             lambda: status_of(kmock, "llama").get("fingerprint") == before
                             and condition(status_of(kmock, "llama"), "Ready").get("status") == "True")
        assert pool_config().fingerprint == before


async def test_a_pool_whose_hash_seed_cannot_work_is_invalid_saying_what_to_change(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    random_seed = pool_body("random-seed")
    random_seed["spec"]["hashSeed"] = "random"
    ktc = json.loads(KTC)
    ktc["kv_connector_extra_config"]["hash_seed"] = "9"
    stated_seed = pool_body("stated-seed", vllm_args=[*LLAMA_ARGS[:-1], json.dumps(ktc)])
    async with OperatorProcess(tmp_path, str(kmock.url)):
        for body in (random_seed, stated_seed):
            await create(kmock, POOLS_URL, body)
        for name, said in (("random-seed", "spec.hashSeed='random': use a decimal integer"),
                           ("stated-seed", "kv_connector_extra_config.hash_seed='9' is set but spec.hashSeed is not")):
            message = await wait_for_async(f"{name}'s Invalid condition",
                                           lambda n=name: condition(status_of(kmock, n), "Invalid").get("status")
                                           == "True" and condition(status_of(kmock, n), "Invalid")["message"])
            assert message.startswith(said), message
            assert obj(kmock, "v1/configmaps", f"{name}-offloading-config") is None


async def test_a_pool_on_the_deprecated_transport_field_works_and_says_so_in_a_condition(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, pool_body("old", sidecar={"transport": "tcp"}))
        await create(kmock, POOLS_URL, pool_body("new", sidecar={"dataPlane": {"transport": "tcp", "lanes": 4}}))
        for name in ("old", "new"):
            await wait_for_async(f"{name} to be Ready",
                                 lambda n=name: condition(status_of(kmock, n), "Ready").get("status") == "True")
        deprecated = condition(status_of(kmock, "old"), "Deprecated")
        assert (deprecated["status"], deprecated["reason"]) == ("True", "DeprecatedField")
        assert deprecated["message"].startswith("spec.sidecar.transport is deprecated: move it to "
                                                "spec.sidecar.dataPlane.transport")
        assert condition(status_of(kmock, "new"), "Deprecated") == {}


def test_operator_cli_refuses_bad_flags_and_missing_credentials_with_one_line(tmp_path: Path) -> None:
    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([KV_OFFLOAD, "operator", *args],
                              capture_output=True, text=True, timeout=60, env=env)

    no_scope = run()
    assert (no_scope.returncode, no_scope.stdout) == (2, "")
    assert no_scope.stderr.strip() == "kv-offload operator: give --namespace NS (repeatable) or --all-namespaces"
    no_certs = run("-n", "ns1", "--webhook-cert-dir", str(tmp_path))
    assert no_certs.returncode == 2
    assert "has no tls.crt or tls.key" in no_certs.stderr and len(no_certs.stderr.strip().splitlines()) == 1
    for flag, given, read in (("--webhook-cert-check-seconds", "0", "0.0"),
                              ("--model-config-check-seconds", "-1", "-1.0"),
                              ("--key-rotation-check-seconds", "0", "0.0"),
                              ("--ready-peers-check-seconds", "0", "0.0")):
        no_interval = run("-n", "ns1", flag, given)
        assert (no_interval.returncode, no_interval.stderr.strip()) == (
            2, f"kv-offload operator: {flag} {read} must be positive")

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(tmp_path / "absent"), HOME=str(tmp_path))
    health, webhook = free_ports(2)
    no_credentials = run("-n", "ns1", "--health-port", str(health), "--webhook-port", str(webhook),
                         env=env)
    assert no_credentials.returncode == 1
    assert no_credentials.stderr.strip().splitlines()[-1].startswith(
        "kv-offload operator: no Kubernetes credentials")


async def test_a_missing_model_config_map_or_keyless_pool_secret_shows_as_waiting_not_ready(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    body = pool_body("llama")
    del body["spec"]["modelConfig"]
    body["spec"]["modelConfigRef"] = {"name": "not-there"}
    await create(kmock, f"/api/v1/namespaces/{NAMESPACE}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keyless-pool-key", "namespace": NAMESPACE},
        "data": {"other": "eA=="}})
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, body)
        await create(kmock, POOLS_URL, pool_body("keyless"))
        ready = await wait_for_async("the waiting condition",
                                     lambda: condition(status_of(kmock, "llama"), "Ready").get("reason") == "Waiting"
                                     and condition(status_of(kmock, "llama"), "Ready"))
        assert ready["status"] == "False"
        assert "ConfigMap 'not-there' named by spec.modelConfigRef does not exist" in ready["message"]
        keyless = await wait_for_async("the keyless pool's waiting condition",
                                       lambda: (ready := condition(status_of(kmock, "keyless"), "Ready"))
                                       .get("reason") == "Waiting" and ready)
        assert "never rotates a pool key silently" in keyless["message"]
        assert obj(kmock, "v1/secrets", "keyless-pool-key")["data"] == {"other": "eA=="}


async def test_with_all_namespaces_pools_in_every_namespace_are_reconciled(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    expected = cli_fingerprint(tmp_path, LLAMA_ARGS)
    async with OperatorProcess(tmp_path, str(kmock.url), scope=["--all-namespaces"]):
        for ns in ("team-a", "team-b"):
            body = pool_body("llama")
            body["metadata"].update(namespace=ns, uid=f"uid-{ns}")
            await create(kmock, f"/apis/kv-offload.io/v1alpha1/namespaces/{ns}/kvoffloadpools", body)
        for ns in ("team-a", "team-b"):
            fingerprint = await wait_for_async(f"the pool in {ns}", lambda: (
                obj(kmock, POOLS, "llama", ns) or {}).get("status", {}).get("fingerprint"))
            assert fingerprint == expected
            assert obj(kmock, "v1/configmaps", "llama-offloading-config", ns) is not None
            assert obj(kmock, "v1/services", "llama-peers", ns)["metadata"]["namespace"] == ns


def secret_entries(k: kmock.KubernetesEmulator, name: str) -> dict[str, bytes]:
    secret = obj(k, "v1/secrets", name) or {}
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}


async def test_the_pool_secret_holds_a_hash_seed_and_an_admin_token_and_an_older_secret_keeps_its_key(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    old_key = os.urandom(32)
    await create(kmock, f"/api/v1/namespaces/{NAMESPACE}/secrets", {  # as the older operator wrote it
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": "old-pool-key", "namespace": NAMESPACE, "labels": {"kv-offload.io/pool": "old"}},
        "data": {"key": base64.b64encode(old_key).decode()}})
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--key-rotation-check-seconds", "0.2"]):
        for name in ("llama", "old"):
            await create(kmock, POOLS_URL, pool_body(name))
        for name in ("llama", "old"):
            await wait_for_async(f"pool {name}", lambda n=name: status_of(kmock, n).get("fingerprint"))
        await wait_for_async("the completed old Secret", lambda: "admin-token" in secret_entries(kmock, "old-pool-key"))
        fresh, completed = secret_entries(kmock, "llama-pool-key"), secret_entries(kmock, "old-pool-key")
        for data in (fresh, completed):
            assert set(data) == {"key", "hash-seed", "admin-token"}
            assert data["hash-seed"].isdigit() and 1 <= int(data["hash-seed"]) <= 4294967295
            assert len(bytes.fromhex(data["admin-token"].decode())) == 32
        assert completed["key"] == old_key
        assert fresh["hash-seed"] != completed["hash-seed"]  # one secret seed per pool

        # Reconciling again (a spec change) rewrites none of them.
        for name in ("llama", "old"):
            await merge_patch(kmock, f"{POOLS_URL}/{name}", {"metadata": {"generation": 2},
                                                              "spec": {"shmSizeLimit": "6Gi"}})
        for name in ("llama", "old"):
            await wait_for_async(f"pool {name} reconciled again",
                                 lambda n=name: status_of(kmock, n).get("observedGeneration") == 2)
        assert secret_entries(kmock, "llama-pool-key") == fresh
        assert secret_entries(kmock, "old-pool-key") == completed

        # A pool created with a rotation request gets a fresh key made for it, not a rotation.
        annotated = pool_body("annotated")
        annotated["metadata"]["annotations"] = {"kv-offload.io/rotate-pool-key": "v1"}
        await create(kmock, POOLS_URL, annotated)
        shown = await wait_for_async("the annotated pool's keyRotation", lambda: (
            status_of(kmock, "annotated").get("keyRotation")))
        assert (shown["phase"], shown["requested"]) == ("Done", "v1")
        assert set(secret_entries(kmock, "annotated-pool-key")) == {"key", "hash-seed", "admin-token"}
        assert obj(kmock, "v1/secrets", "annotated-pool-key")["metadata"]["annotations"] == {
            "kv-offload.io/rotated-for": "v1"}
    secret_writes = [r for r in list(kmock) if r.resource is not None and r.resource.plural == "secrets"
                     and str(r.method.value).upper() == "PATCH"]
    assert [sorted((r.data or {}).get("data") or {}) for r in secret_writes] == [["admin-token", "hash-seed"]]


async def test_rotating_the_pool_key_keeps_the_old_key_as_previous_key_until_the_grace_ends(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    body = pool_body("llama")
    body["spec"]["keyRotationGraceSeconds"] = 2  # the CRD asks for 60 at least; kmock does not check
    async with OperatorProcess(tmp_path, str(kmock.url),
                               extra_args=["--key-rotation-check-seconds", "0.2"]) as operator:
        await create(kmock, POOLS_URL, body)
        await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
        before = secret_entries(kmock, "llama-pool-key")
        assert "previous-key" not in before

        await merge_patch(kmock, f"{POOLS_URL}/llama",
                          {"metadata": {"annotations": {"kv-offload.io/rotate-pool-key": "2026-03-01"}}})
        rotating = await wait_for_async("the previous key",
                                        lambda: "previous-key" in (entries := secret_entries(kmock, "llama-pool-key"))
                                        and entries)
        assert rotating["previous-key"] == before["key"] and rotating["key"] != before["key"]
        assert len(rotating["key"]) == 32
        assert (rotating["hash-seed"], rotating["admin-token"]) == (before["hash-seed"], before["admin-token"])
        notes = obj(kmock, "v1/secrets", "llama-pool-key")["metadata"]["annotations"]
        assert notes["kv-offload.io/rotated-for"] == "2026-03-01"
        shown = await wait_for_async("status.keyRotation Rotating", lambda: (
            status_of(kmock, "llama").get("keyRotation") or {}).get("phase") == "Rotating"
            and status_of(kmock, "llama")["keyRotation"])
        assert shown["requested"] == "2026-03-01"
        assert shown["previousKeyExpires"] == notes["kv-offload.io/previous-key-expires"]

        done = await wait_for_async("the previous key removed after the grace", lambda: (
            "previous-key" not in secret_entries(kmock, "llama-pool-key")
            and (status_of(kmock, "llama").get("keyRotation") or {}).get("phase") == "Done"
            and status_of(kmock, "llama")["keyRotation"]), timeout=20)
        assert done["requested"] == "2026-03-01" and "previousKeyExpires" not in done
        after = secret_entries(kmock, "llama-pool-key")
        assert after == {"key": rotating["key"], "hash-seed": before["hash-seed"],
                         "admin-token": before["admin-token"]}
        assert "kv-offload.io/previous-key-expires" not in obj(kmock, "v1/secrets", "llama-pool-key")[
            "metadata"]["annotations"]

        # The same value again (the pool is written, the annotation stays) rotates nothing.
        await merge_patch(kmock, f"{POOLS_URL}/llama",
                          {"metadata": {"annotations": {"kv-offload.io/rotate-pool-key": "2026-03-01",
                                                        "example.com/touched": "yes"}}})
        await asyncio.sleep(1.5)
        assert secret_entries(kmock, "llama-pool-key") == after
        assert status_of(kmock, "llama")["keyRotation"] == done
        log = operator.log()
        assert "Pool ns1/llama: pool key rotated for '2026-03-01'" in log
        assert "Pool ns1/llama: the previous pool key expired and was removed." in log
        assert base64.b64encode(before["key"]).decode() not in log  # no key ever reaches the log


def events_about(k: kmock.KubernetesEmulator, name: str) -> list[dict[str, Any]]:
    """The Events the operator posted about the pool ``name``."""
    events = [json.loads(json.dumps(dict(o.raw))) for (res, _, _), o in list(k.objects.items())
              if res == kmock.resource("v1/events") and not o.deleted]
    return [e for e in events if (e.get("involvedObject") or {}).get("name") == name]


async def test_an_upgrade_that_retranslates_an_unchanged_spec_says_so_in_a_condition_and_an_event(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, pool_body("llama"))
        fingerprint = await wait_for_async("the pool status", lambda: status_of(kmock, "llama").get("fingerprint"))
    st = status_of(kmock, "llama")
    assert st["translatedBy"].startswith("kv-offload ")
    assert condition(st, "FingerprintChangedByUpgrade") == {}  # a first translation is no change
    # What an older operator whose translation differed left behind, for the same spec generation.
    await merge_patch(kmock, f"{POOLS_URL}/llama/status",
                      {"status": {"fingerprint": "00000000000000aa", "translatedBy": "kv-offload 0.0.9"}})

    async with OperatorProcess(tmp_path, str(kmock.url)):  # the upgraded operator resumes
        changed = await wait_for_async("the upgrade condition", lambda: condition(
            status_of(kmock, "llama"), "FingerprintChangedByUpgrade"))
        posted = await wait_for_async("the upgrade event", lambda: [
            e for e in events_about(kmock, "llama") if e.get("reason") == "FingerprintChangedByUpgrade"])
    assert changed["status"] == "True"
    for text in ("00000000000000aa", "kv-offload 0.0.9", fingerprint, st["translatedBy"], "generation 1"):
        assert text in changed["message"], text
    assert posted[0]["type"] == "Warning" and posted[0]["message"] == changed["message"]
    assert status_of(kmock, "llama")["fingerprint"] == fingerprint


# The pool's own objects a hand may edit or delete: kind -> (API resource, name, plural).
_DRIFTING = {"ConfigMap": ("v1/configmaps", "llama-offloading-config", "configmaps"),
             "Secret": ("v1/secrets", "llama-pool-key", "secrets")}


async def _edited_then_deleted(kmock: kmock.KubernetesEmulator, operator: OperatorProcess, kind: str,
                               edit: dict[str, Any]) -> dict:
    """Once the pool's ``kind`` is written: merge ``edit`` into it by hand and wait for it reverted,
    then delete it and wait for it created again with the same data, each counted in
    drift_reverted_total{kind}; the operator's metric samples after the second count."""
    resource, name, plural = _DRIFTING[kind]
    url = f"/api/v1/namespaces/{NAMESPACE}/{plural}/{name}"

    def data() -> Any:
        return (obj(kmock, resource, name) or {}).get("data")

    def reverted(samples: Any) -> float:
        return value(samples, "kv_offload_operator_drift_reverted_total", kind=kind)

    written = await wait_for_async(f"the pool {kind}", data)
    await merge_patch(kmock, url, edit)
    await wait_for_async("the edit reverted", lambda: data() == written)
    # Counted once, or twice when the pool's first reconciliations raced the edit and left a part of it.
    reverts = reverted(await wait_for_metrics(operator.metrics_port, lambda s: reverted(s) >= 1, log=operator.log))
    # A hand delete while the pool exists: created again with the same data (a Secret's key, seed and token).
    resp = await kmock.delete(url)
    assert resp.status == 200, await resp.text()
    await wait_for_async(f"the {kind} created again", lambda: data() == written)
    # At least once more: a revert of the edit that raced the first reconciliations may be counted
    # late, so an exact count could be stepped over between two scrapes and never seen.
    return await wait_for_metrics(operator.metrics_port, lambda s: reverted(s) >= reverts + 1, log=operator.log)


async def test_a_hand_edited_or_deleted_pool_configmap_is_reverted_within_seconds_counted_and_reported(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    async with OperatorProcess(tmp_path, str(kmock.url)) as operator:
        await create(kmock, POOLS_URL, pool_body("llama"))
        # A hand edit: the config changed and a key added.
        samples = await _edited_then_deleted(kmock, operator, "ConfigMap",
                                             {"data": {"offloading_config.json": "{}", "extra": "x"}})
        assert value(samples, "kv_offload_operator_reconciles_total", result="error") == 0
        reverted = await wait_for_async("the revert events", lambda: [
            e for e in events_about(kmock, "llama") if e.get("reason") == "ConfigMapReverted"] or None)
    assert "edit the KVOffloadPool's spec instead" in reverted[0]["message"]
    assert reverted[0]["type"] == "Warning"
    # The watch asks the API server for the operator's own ConfigMaps only.
    watches = [r for r in requests_to(kmock, "GET") if r.url.path.endswith("/configmaps") and r.params.get("watch")]
    assert watches and all(r.params.get("labelSelector") == "app.kubernetes.io/managed-by=kv-offload"
                           for r in watches)


async def test_a_hand_edited_or_deleted_pool_secret_is_read_back_and_reverted_with_the_same_values(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=["--drift-check-seconds", "0.3"]) as operator:
        await create(kmock, POOLS_URL, pool_body("llama"))
        # A hand edit: another key, and an entry added.
        other = base64.b64encode(b"x" * 32).decode()
        await _edited_then_deleted(kmock, operator, "Secret", {"data": {"key": other, "extra": other}})
    secret = obj(kmock, "v1/secrets", "llama-pool-key")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
