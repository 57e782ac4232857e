"""The last release's sidecar and this one's in one pool: chunks shared both ways, no refusal.

The recorded commit (``previous_release.LAST_RELEASE``) runs from a temporary git worktree,
removed afterwards; each sidecar has its stand-in engine (``pool.client``, this tree's client).
That release's sidecar also runs on what this operator writes and injects for a pool (its
ConfigMap, the sidecar container's flags and env): a pinned older image works.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import pytest
from kv_offload_sidecar.engine.client import EngineClient, LookupReply
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION
from kv_offload_testing.local_pool import LocalPool, example_config, free_port_block, make_workdir
from kv_offload_testing.sidecar_process import SidecarProcess
from kv_offload_operator.pools import pool_objects
from kv_offload_operator.pools.pool_spec import SidecarSpec
from kv_offload_operator.translation.declared_identity import declared_identity
from kv_offload_operator.translation.translate import pool_config
from kv_offload_operator.webhook import pod_patch
from kv_offload_tools.previous_release import (
    LAST_RELEASE_WIRE,
    checked_out,
    flags_refused,
    launcher,
    release_command,
)

# A pool as the operator tests make one: Llama-3.1-8B served with the offloading connector.
OPERATOR_FIXTURES = Path(__file__).parents[1] / "operator" / "fixtures_operator"
KTC = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}})
VLLM_ARGS = ["serve", "meta-llama/Llama-3.1-8B", "--block-size", "16", "--kv-transfer-config", KTC]
POOL = {"apiVersion": "kv-offload.io/v1alpha1", "kind": "KVOffloadPool",
        "metadata": {"name": "llama", "namespace": "ns1", "uid": "uid-llama"}, "spec": {"vllmArgs": VLLM_ARGS}}

CHUNK = example_config().kv_bytes_per_chunk
HANDSHAKES = "kv_offload_handshakes_total"


def new_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + (0).to_bytes(4, "big") for _ in range(n)]


def write_chunks(client: EngineClient, keys: list[bytes]) -> dict[bytes, bytes]:
    data = {k: os.urandom(client.slot_bytes) for k in keys}
    assert client.store(keys, lambda i, view: view.__setitem__(slice(None), data[keys[i]])) == len(keys)
    return data


def read_chunks(client: EngineClient, keys: list[bytes]) -> list[bytes]:
    out: dict[int, bytes] = {}
    n = client.load(keys, lambda i, view: out.__setitem__(i, bytes(view)), 5.0)
    return [out[i] for i in range(n)]


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_the_last_release_and_this_one_share_chunks_both_ways_in_one_pool(transport):
    with checked_out() as release:
        with LocalPool(2, transport=transport, capacity_bytes=64 * CHUNK,
                       launcher=launcher(release, {"sidecar-0"})) as pool:
            previous, today = pool[0], pool[1]
            assert previous.status()["wire_version"] == LAST_RELEASE_WIRE
            assert today.status()["wire_version"] == WIRE_VERSION
            assert (today.status()["wire_min"], today.status()["wire_max"]) == (LAST_RELEASE_WIRE, WIRE_VERSION)
            # the releases a pool runs, from /metrics: the last release has no build_info series
            assert today.metric("kv_offload_build_info", wire=WIRE_VERSION) == 1
            assert previous.metric("kv_offload_build_info") == 0
            for holder, reader in ((0, 1), (1, 0)):
                keys = new_keys(4)
                data = write_chunks(pool.client(holder), keys)
                pool.wait_directory_current()
                client = pool.client(reader)
                assert client.lookup(keys) == LookupReply(local=0, peer=4), (holder, reader)
                assert read_chunks(client, keys) == [data[k] for k in keys]
            for member in (previous, today):
                assert member.metric(HANDSHAKES, result="rejected") == 0
                assert member.metric(HANDSHAKES, result="accepted") >= 1
            # this release speaks the last one's version to it
            assert [p.get("wire_version") for p in today.peers()] == [LAST_RELEASE_WIRE]
        assert os.path.isdir(release)
    assert not os.path.exists(release)


def test_the_last_releases_sidecar_accepts_every_flag_this_operator_injects():
    # a pool pinned to the last release's image (spec.sidecar.image) under this operator
    spec = SidecarSpec(image="kv-offload:previous", resources={}, capacity_bytes=1 << 30, transport="tcp",
                       base_port=5710, data_port=5810, shm_size_limit=None, tls_secret="pool-tls",
                       engine_metrics_url="http://127.0.0.1:8000/metrics")
    container = pod_patch.sidecar_container(pool_name="llama", namespace="ns1", sidecar=spec,
                                            dp_indices=(0, 1), shm_volume=pod_patch.SHM_VOLUME)
    assert container["args"][0] == "sidecar" and "--tls-ca-file" in container["args"]
    with checked_out() as release:
        assert flags_refused(release, container["args"]) is None
        assert "--no-such-flag" in flags_refused(release, [*container["args"], "--no-such-flag"])


def test_the_last_releases_sidecar_serves_on_this_operators_configmap_flags_and_env():
    # what this operator writes for a pool (its ConfigMap) and injects into its pods (the sidecar
    # container), run by the last release's sidecar with the pod's mounts as local files
    model = json.loads((OPERATOR_FIXTURES / "llama-3.1-8b-config.json").read_text())
    config = pool_config(VLLM_ARGS, model)
    configmap = pool_objects.configmap_for(POOL, config, declared_identity(VLLM_ARGS, model))
    spec = SidecarSpec(image="kv-offload:0.1.0", resources={}, capacity_bytes=2 * config.kv_bytes_per_chunk,
                       transport="tcp", base_port=free_port_block(1), data_port=free_port_block(1),
                       shm_size_limit=None, tls_secret=None, engine_metrics_url="", hash_seed="4321")
    pod = pod_patch.pod_patch(
        {"metadata": {"name": "p", "namespace": "ns1"}, "spec": {"containers": [
            {"name": "vllm", "image": "vllm/vllm-openai:v0.34.0", "command": ["vllm"], "args": VLLM_ARGS}]}},
        POOL, fingerprint=config.fingerprint, sidecar=spec)
    [container] = [op["value"] for op in pod if op["path"] == "/spec/initContainers"][0][1:]
    workdir = make_workdir("kvo-release-")
    files = {pod_patch.CONFIG_PATH: configmap["data"][pool_objects.CONFIG_KEY],
             pod_patch.POOL_KEY_PATH: secrets.token_hex(32), pod_patch.ADMIN_TOKEN_PATH: "admin-token"}
    paths = {pod_patch.SHM_DIR: workdir, pod_patch.PREVIOUS_KEY_PATH: os.path.join(workdir, "previous-key")}
    for mounted, text in files.items():
        paths[mounted] = os.path.join(workdir, os.path.basename(mounted))
        with open(paths[mounted], "w") as fh:
            fh.write(text)
    args = [paths.get(a, a) for a in container["args"]]
    values = {"VLLM_P2P_SIDE_CHANNEL_HOST": "127.0.0.1", "KV_OFFLOAD_CPU_REQUEST_MILLICORES": "250"}
    env = {**os.environ, **{e["name"]: e.get("value", values.get(e["name"])) for e in container["env"]}}
    assert None not in env.values() and env["PYTHONHASHSEED"] == "4321"
    try:
        with checked_out() as release:
            sc = SidecarProcess(0, "previous", spec.base_port, (0,), "tcp",
                                [*release_command(release), *args, "--parent-pid", str(os.getpid())], env,
                                os.path.join(workdir, "sidecar.log"), False, admin_token="admin-token",
                                model_identity=None)
            sc.start()
            try:
                status = sc.status()
                assert (status["wire_version"], status["fingerprint"]) == (LAST_RELEASE_WIRE, config.fingerprint)
                assert status["store"]["slot_bytes"] == config.kv_bytes_per_chunk
                assert status["dp_indices"] == [0]
            finally:
                assert sc.terminate() == 0, sc.log_tail()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
