"""spec.injectKVTransferConfig: kv-offload's --kv-transfer-config added to a vLLM container that has none
(kv_transfer.py and its use in pod_patch.py), without a cluster."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
from kv_offload_operator.pools import kv_transfer
from kv_offload_operator.pools.pool_pod import container_argv
from kv_offload_operator.webhook import pod_patch as pods
from kv_offload_operator.translation.translate import pool_config
from kv_offload_operator.translation.vllm_args import parse_vllm_args
from operator_harness import KTC, llama_config, pool_body
from pool_support import inject_into, pod, vllm

SERVE = ["serve", "meta-llama/Llama-3.1-8B", "--block-size", "16"]
CONNECTOR = kv_transfer.InjectedConnector(cpu_bytes_to_use=2 << 30, block_size=32)


def injecting_pool(**inject: Any) -> dict[str, Any]:
    body = pool_body("llama", vllm_args=["vllm", *SERVE])
    body["spec"]["injectKVTransferConfig"] = inject
    return body


def test_the_injected_config_is_the_tiering_connector_with_the_kv_offload_tier() -> None:
    assert kv_transfer.injected_connector({}) is None
    defaults = kv_transfer.injected_connector({"injectKVTransferConfig": {}})
    assert defaults == kv_transfer.InjectedConnector(cpu_bytes_to_use=8 << 30, block_size=64)
    assert kv_transfer.injected_connector({"injectKVTransferConfig": {"cpuBytesToUse": "2Gi", "blockSize": 32}}) \
        == CONNECTOR
    assert json.loads(CONNECTOR.text()) == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 << 30,
                                      "block_size": 32, "secondary_tiers": [
                                          {"type": "KVOffloadSecondaryTier",
                                           "module_path": "kv_offload_sidecar.engine.vllm_tier"}]}}
    for bad, said in ((True, "must be an object"), ({"cpuBytesToUse": "lots"}, "cpuBytesToUse='lots'"),
                      ({"blockSize": 0}, "blockSize=0")):
        with pytest.raises(ValueError, match=rf"spec\.injectKVTransferConfig.*{said}"):
            kv_transfer.injected_connector({"injectKVTransferConfig": bad})


def test_the_pool_translates_what_the_pods_will_run() -> None:
    argv = kv_transfer.effective_argv(["vllm", *SERVE], CONNECTOR, "spec.vllmArgs")
    assert argv == ["vllm", *SERVE, "--kv-transfer-config", CONNECTOR.text()]
    config = pool_config(argv, llama_config())
    assert config.cache.blocks_per_chunk == 2 and config.extra_config["cpu_bytes_to_use"] == 2 << 30
    own = ["vllm", *SERVE, "--kv-transfer-config", KTC]
    assert kv_transfer.effective_argv(own, CONNECTOR, "spec.vllmArgs") == own  # left as it is
    with pytest.raises(ValueError, match=r"^spec\.vllmArgs sets --kv-offloading-size"):
        kv_transfer.effective_argv(["vllm", *SERVE, "--kv-offloading-size", "4"], CONNECTOR, "spec.vllmArgs")


def test_the_webhook_appends_the_flag_to_the_vllm_args_and_the_pod_translates_to_the_pool() -> None:
    body = injecting_pool(cpuBytesToUse="2Gi", blockSize=32)
    out = inject_into(body, pod(vllm(list(SERVE))), validate=True)
    container = out["spec"]["containers"][0]
    assert container["args"] == [*SERVE, "--kv-transfer-config", CONNECTOR.text()]
    pool = pool_config(kv_transfer.effective_argv(["vllm", *SERVE], CONNECTOR, "x"), llama_config())
    # The pod as admitted (and as sent, with the connector) translates to the pool's fingerprint.
    assert pods.pod_identity_problem(out, pool, llama_config()) is None
    assert pods.pod_identity_problem(pod(vllm(list(SERVE))), pool, llama_config(), connector=CONNECTOR) is None
    # /dev/shm holds the 4 GiB store, the injected 2 GiB primary tier and 1 GiB.
    shm = next(v for v in out["spec"]["volumes"] if v["name"] == pods.SHM_VOLUME)
    assert shm["emptyDir"]["sizeLimit"] == "7Gi"
    # A container with its own --kv-transfer-config is left as it is.
    own = inject_into(body, pod(vllm([*SERVE, "--kv-transfer-config", KTC])), validate=True)
    assert own["spec"]["containers"][0]["args"] == [*SERVE, "--kv-transfer-config", KTC]


def test_a_single_command_shell_script_gets_the_flag_and_a_compound_one_is_refused() -> None:
    body = injecting_pool()
    connector = kv_transfer.injected_connector(body["spec"])
    assert connector is not None
    script = "exec vllm serve meta-llama/Llama-3.1-8B \\\n  --block-size 16 --port 8000"
    out = inject_into(body, pod(vllm(command=["/bin/sh", "-c"], args=[script])), validate=True)
    new_script = out["spec"]["containers"][0]["args"][0]
    assert new_script.endswith(" --kv-transfer-config " + shlex.quote(connector.text()))
    assert parse_vllm_args(container_argv(out["spec"]["containers"][0])).kv_transfer_config == connector.config()
    inline = inject_into(body, pod(vllm([], command=["sh", "-c", "vllm serve meta-llama/Llama-3.1-8B"])), validate=True)
    assert inline["spec"]["containers"][0]["command"][2].startswith("vllm serve meta-llama/Llama-3.1-8B --kv-")
    for compound in ("pip install x && vllm serve m", "vllm serve m | tee log", "cd /w; vllm serve m",
                     "vllm serve m\nsleep 1", "vllm serve $(cat /model)"):
        with pytest.raises(ValueError, match=r"runs a shell script with several commands"):
            inject_into(body, pod(vllm(command=["/bin/sh", "-c"], args=[compound])), validate=True)
