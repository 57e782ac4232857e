"""The operator's --sidecar-base-port / --sidecar-data-port (the chart's sidecar.controlPort / dataPort)
are the ports of every pool that sets none: peer Service, injected sidecar and its flags."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kmock
import pytest
from operator_harness import (
    KV_OFFLOAD,
    POOLS,
    POOLS_URL,
    OperatorProcess,
    assert_within_rbac,
    create,
    emulate_cluster,
    make_tls,
    obj,
    pool_body,
    wait_for,
)
from webhook_support import Webhook, admitted, sidecar_flags, vllm_pod

pytestmark = pytest.mark.timeout(120)


async def test_pools_without_ports_get_the_operators_and_pools_with_ports_keep_theirs(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    ca = make_tls(tmp_path / "certs")
    flags = ["--sidecar-base-port", "6710", "--sidecar-data-port", "6810", "--webhook-cert-dir", str(tmp_path / "certs")]
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=flags) as operator:
        await create(kmock, POOLS_URL, pool_body("llama"))
        await create(kmock, POOLS_URL, pool_body("own", sidecar={"basePort": 7710, "dataPort": 7810}))
        for name in ("llama", "own"):
            await wait_for(f"pool {name}", lambda n=name: (obj(kmock, POOLS, n) or {}).get("status", {}).get("fingerprint"))
        ports = {name: {p["name"]: p["port"] for p in obj(kmock, "v1/services", f"{name}-peers")["spec"]["ports"]}
                 for name in ("llama", "own")}
        assert ports == {"llama": {"kvo-ctrl-0": 6710, "kvo-data": 6810}, "own": {"kvo-ctrl-0": 7710, "kvo-data": 7810}}
        webhook = Webhook(operator.webhook_port, ca)
        await webhook.wait_listening()
        pod = vllm_pod("llama")
        result = admitted(pod, await webhook.admit(pod), validate=False)
        sidecar = next(c for c in result["spec"]["initContainers"] if c["name"] == "kv-offload-sidecar")
        assert sidecar_flags(result)["--data-port"] == "6810"
        assert [p["containerPort"] for p in sidecar["ports"]] == [6710, 6810]
    assert_within_rbac(kmock)


def test_port_flags_that_cannot_work_are_refused_in_one_line() -> None:
    for args, said in ((["--sidecar-data-port", "5710"], "--sidecar-data-port and --sidecar-base-port must differ"),
                       (["--sidecar-base-port", "65500"], "--sidecar-base-port 65500 is not a base port")):
        done = subprocess.run([KV_OFFLOAD, "operator", "-n", "ns1", *args], capture_output=True, text=True,
                              timeout=60, check=False)
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr.strip().startswith(f"kv-offload operator: {said}")
