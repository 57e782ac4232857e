"""The operator's --sidecar-* flags (the chart's sidecar.*) are the sidecar settings of every pool that sets none.

Ports (--sidecar-base-port / --sidecar-data-port, the chart's sidecar.controlPort / dataPort):
the peer Service, the injected sidecar and its flags. Policy (--sidecar-prefill-tokens-per-second /
--sidecar-peer-copies, the chart's sidecar.prefillTokensPerSecond / peerCopies): the injected
sidecar's --prefill-tokens-per-second / --peer-copies. A pool's own values win, bad ones make it
Invalid, and flags that cannot work stop the operator in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kmock
import pytest
from operator_harness import KV_OFFLOAD, POOLS, POOLS_URL, create, obj, pool_body, wait_for
from refusal import refusal
from webhook_support import SIDECAR_NAME, Webhook, admitted, serving_cluster, sidecar_flags, vllm_pod

pytestmark = pytest.mark.timeout(240)


def _invalid_message(k: kmock.KubernetesEmulator, name: str) -> str | None:
    conditions = ((obj(k, POOLS, name) or {}).get("status") or {}).get("conditions") or []
    invalid = next((c for c in conditions if c["type"] == "Invalid"), {})
    return invalid.get("message") if invalid.get("status") == "True" else None


async def _injected(webhook: Webhook, pool: str) -> dict[str, Any]:
    pod = vllm_pod(pool)
    return admitted(pod, await webhook.admit(pod), validate=False)


async def test_pools_without_ports_get_the_operators_and_pools_with_ports_keep_theirs(tmp_path: Path) -> None:
    pools = [pool_body("llama"), pool_body("own", sidecar={"basePort": 7710, "dataPort": 7810})]
    flags = ["--sidecar-base-port", "6710", "--sidecar-data-port", "6810"]
    async with serving_cluster(tmp_path, pools, operator_args=flags) as cluster:
        ports = {name: {p["name"]: p["port"] for p in obj(cluster.api, "v1/services", f"{name}-peers")["spec"]["ports"]}
                 for name in ("llama", "own")}
        assert ports == {"llama": {"kvo-ctrl-0": 6710, "kvo-data": 6810}, "own": {"kvo-ctrl-0": 7710, "kvo-data": 7810}}
        result = await _injected(cluster.webhook, "llama")
        sidecar = next(c for c in result["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
        assert sidecar_flags(result)["--data-port"] == "6810"
        assert [p["containerPort"] for p in sidecar["ports"]] == [6710, 6810]


async def test_pools_without_a_policy_get_the_operators_and_pools_with_one_keep_theirs(tmp_path: Path) -> None:
    pools = [pool_body("llama"),
             pool_body("own", sidecar={"prefillTokensPerSecond": 0, "peerCopies": "drop", "transport": "nixl"})]
    flags = ["--sidecar-prefill-tokens-per-second", "12500.5", "--sidecar-peer-copies", "cold"]
    async with serving_cluster(tmp_path, pools, operator_args=flags) as cluster:
        await create(cluster.api, POOLS_URL, pool_body("negative", sidecar={"prefillTokensPerSecond": -1}))
        await create(cluster.api, POOLS_URL, pool_body("keep", sidecar={"peerCopies": "keep"}))
        for name, said in (("negative", "spec.sidecar.prefillTokensPerSecond=-1: use a number >= 0"),
                           ("keep", "spec.sidecar.peerCopies='keep': use one of ['drop', 'cold']")):
            message = await wait_for(f"{name}'s Invalid condition", lambda n=name: _invalid_message(cluster.api, n))
            assert message.startswith(said), message
            assert obj(cluster.api, "v1/configmaps", f"{name}-offloading-config") is None
        defaults = sidecar_flags(await _injected(cluster.webhook, "llama"))
        assert (defaults["--prefill-tokens-per-second"], defaults["--peer-copies"]) == ("12500.5", "cold")
        own = sidecar_flags(await _injected(cluster.webhook, "own"))
        assert (own["--prefill-tokens-per-second"], own["--peer-copies"], own["--transport"]) == ("0", "drop", "nixl")


@pytest.mark.parametrize("args, said", [
    (["--sidecar-data-port", "5710"], "--sidecar-data-port and --sidecar-base-port must differ"),
    (["--sidecar-base-port", "65500"], "--sidecar-base-port 65500 is not a base port"),
    (["--sidecar-prefill-tokens-per-second", "-1"], "--sidecar-prefill-tokens-per-second -1.0 must be a number >= 0"),
    (["--sidecar-prefill-tokens-per-second", "nan"], "--sidecar-prefill-tokens-per-second nan must be a number >= 0"),
    (["--sidecar-prefill-tokens-per-second", "fast"], "argument --sidecar-prefill-tokens-per-second: invalid float"),
    (["--sidecar-peer-copies", "keep"], "argument --sidecar-peer-copies: invalid choice: 'keep'"),
])
def test_sidecar_flags_that_cannot_work_are_refused_in_one_line(args: list[str], said: str) -> None:
    line = refusal([KV_OFFLOAD, "operator"], "-n", "ns1", *args)
    assert line.startswith(f"kv-offload operator: {said}"), line
