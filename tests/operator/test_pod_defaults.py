"""What a pool's sidecar takes from the pod it joins (webhook/pod_defaults.py): vLLM's own
/metrics for the prefill rate, and a CPU request that gives a GPU pod's sidecar its lanes."""

from __future__ import annotations

from typing import Any

import pytest
from kv_offload_operator.pools import pool_pod, pool_spec
from pool_support import KTC, inject, pod, vllm


def sidecar_of(p: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in p["spec"]["initContainers"] if c["name"] == pool_pod.SIDECAR_NAME)


def flag(container: dict[str, Any], name: str) -> str | None:
    args = container["args"]
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize(("serve", "url"), [
    ([], "http://127.0.0.1:8000/metrics"),
    (["--port", "9001"], "http://127.0.0.1:9001/metrics"),
    (["--host=0.0.0.0", "--port=9002"], "http://127.0.0.1:9002/metrics"),
    (["--host", "10.1.2.3"], "http://10.1.2.3:8000/metrics"),
    (["--host", "fd00::7", "--port", "8100"], "http://[fd00::7]:8100/metrics"),
], ids=["default-port", "port", "all-addresses", "host", "ipv6"])
def test_the_sidecar_learns_the_prefill_rate_from_its_own_vllm_by_default(serve: list[str], url: str) -> None:
    out = inject(pod(vllm(["serve", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", KTC, *serve])))
    assert flag(sidecar_of(out), "--engine-metrics-url") == url


def test_a_pools_engine_metrics_url_wins_over_the_pods() -> None:
    out = inject(pod(vllm()), engineMetricsURL="http://metrics.example:9400/metrics")
    assert flag(sidecar_of(out), "--engine-metrics-url") == "http://metrics.example:9400/metrics"


def gpu_vllm(count: str = "1") -> dict[str, Any]:
    return vllm(resources={"limits": {"nvidia.com/gpu": count}})


def test_a_gpu_pods_sidecar_requests_the_cpus_its_lanes_need() -> None:
    assert sidecar_of(inject(pod(gpu_vllm())))["resources"]["requests"]["cpu"] == pool_spec.GPU_SIDECAR_CPU
    assert sidecar_of(inject(pod(vllm())))["resources"]["requests"]["cpu"] == pool_spec.DEFAULT_SIDECAR_CPU
    assert sidecar_of(inject(pod(gpu_vllm("0"))))["resources"]["requests"]["cpu"] == pool_spec.DEFAULT_SIDECAR_CPU


def test_a_pools_own_sidecar_resources_stand_beside_a_gpu() -> None:
    out = inject(pod(gpu_vllm()), resources={"requests": {"cpu": "1500m"}})
    assert sidecar_of(out)["resources"]["requests"]["cpu"] == "1500m"


def test_a_gpu_pods_sidecar_runs_the_plane_measured_on_a_gpu_with_a_lane_per_core() -> None:
    side = sidecar_of(inject(pod(gpu_vllm())))
    assert flag(side, "--transport") == pool_spec.GPU_TRANSPORT == "tcp"
    # Lanes stay the sidecar's own count (no --lanes), one per core of its CPU budget: GPU_SIDECAR_CPU.
    assert flag(side, "--lanes") is None and pool_spec.DEFAULT_LANES == 0
    assert side["resources"]["requests"]["cpu"] == pool_spec.GPU_SIDECAR_CPU
    assert flag(sidecar_of(inject(pod(vllm()))), "--transport") == pool_spec.DEFAULT_TRANSPORT


@pytest.mark.parametrize("sidecar, transport, lanes", [
    ({"dataPlane": {"transport": "ucx", "lanes": 2}}, "ucx", "2"),
    ({"dataPlane": {"lanes": 8}}, "tcp", "8"),  # lanes alone: the transport is still the GPU's
    ({"transport": "nixl"}, "nixl", None),  # the deprecated field still names the pool's choice
    ({"tls": {"secretName": "pool-tls"}}, "tcp", None),
], ids=["data-plane", "lanes-only", "deprecated-transport", "tls"])
def test_a_pools_data_plane_wins_over_the_gpu_default(sidecar: dict[str, Any], transport: str,
                                                      lanes: str | None) -> None:
    side = sidecar_of(inject(pod(gpu_vllm()), **sidecar))
    assert (flag(side, "--transport"), flag(side, "--lanes")) == (transport, lanes)
