"""The operator's --sidecar-prefill-tokens-per-second / --sidecar-peer-copies (the chart's
sidecar.prefillTokensPerSecond / peerCopies) are the policy of every pool that sets none: the
injected sidecar's --prefill-tokens-per-second / --peer-copies; a pool's own values win, bad ones
make it Invalid, and bad flags stop the operator in one line."""

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


def _invalid_message(k: kmock.KubernetesEmulator, name: str) -> str | None:
    conditions = ((obj(k, POOLS, name) or {}).get("status") or {}).get("conditions") or []
    invalid = next((c for c in conditions if c["type"] == "Invalid"), {})
    return invalid.get("message") if invalid.get("status") == "True" else None


async def _sidecar_flags(webhook: Webhook, pool: str) -> dict[str, str]:
    pod = vllm_pod(pool)
    return sidecar_flags(admitted(pod, await webhook.admit(pod), validate=False))


async def test_pools_without_a_policy_get_the_operators_and_pools_with_one_keep_theirs(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    ca = make_tls(tmp_path / "certs")
    flags = ["--sidecar-prefill-tokens-per-second", "12500.5", "--sidecar-peer-copies", "cold",
             "--webhook-cert-dir", str(tmp_path / "certs")]
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=flags) as operator:
        await create(kmock, POOLS_URL, pool_body("llama"))
        await create(kmock, POOLS_URL, pool_body("own", sidecar={"prefillTokensPerSecond": 0, "peerCopies": "drop",
                                                                 "transport": "nixl"}))
        await create(kmock, POOLS_URL, pool_body("negative", sidecar={"prefillTokensPerSecond": -1}))
        await create(kmock, POOLS_URL, pool_body("keep", sidecar={"peerCopies": "keep"}))
        for name in ("llama", "own"):
            await wait_for(f"pool {name}", lambda n=name: (obj(kmock, POOLS, n) or {}).get("status", {}).get("fingerprint"))
        for name, said in (("negative", "spec.sidecar.prefillTokensPerSecond=-1: use a number >= 0"),
                           ("keep", "spec.sidecar.peerCopies='keep': use one of ['drop', 'cold']")):
            message = await wait_for(f"{name}'s Invalid condition", lambda n=name: _invalid_message(kmock, n))
            assert message.startswith(said), message
            assert obj(kmock, "v1/configmaps", f"{name}-offloading-config") is None
        webhook = Webhook(operator.webhook_port, ca)
        await webhook.wait_listening()
        defaults = await _sidecar_flags(webhook, "llama")
        assert (defaults["--prefill-tokens-per-second"], defaults["--peer-copies"]) == ("12500.5", "cold")
        own = await _sidecar_flags(webhook, "own")
        assert (own["--prefill-tokens-per-second"], own["--peer-copies"], own["--transport"]) == ("0", "drop", "nixl")
    assert_within_rbac(kmock)


@pytest.mark.parametrize("args, said", [
    (["--sidecar-prefill-tokens-per-second", "-1"], "--sidecar-prefill-tokens-per-second -1.0 must be a number >= 0"),
    (["--sidecar-prefill-tokens-per-second", "nan"], "--sidecar-prefill-tokens-per-second nan must be a number >= 0"),
    (["--sidecar-prefill-tokens-per-second", "fast"], "argument --sidecar-prefill-tokens-per-second: invalid float"),
    (["--sidecar-peer-copies", "keep"], "argument --sidecar-peer-copies: invalid choice: 'keep'"),
])
def test_policy_flags_that_cannot_work_are_refused_in_one_line(args: list[str], said: str) -> None:
    done = subprocess.run([KV_OFFLOAD, "operator", "-n", "ns1", *args], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.strip().startswith(f"kv-offload operator: {said}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
