"""Shared pieces of the operator's pure tests (no cluster): pool and pod bodies, injection."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
from kv_offload_operator.webhook import pod_patch as pods
from kv_offload_operator.pools import pool_spec
from operator_harness import KTC, pool_body

# Kubernetes version whose schemas kubernetes_validate checks objects against.
K8S = "1.33.0"


def pool(**sidecar: Any) -> dict[str, Any]:
    return pool_body("llama", sidecar=sidecar or None)


def hash_seed_pool(seed: Any = None, **sidecar: Any) -> dict[str, Any]:
    body = pool(**sidecar)
    if seed is not None:
        body["spec"]["hashSeed"] = seed
    return body


def sidecar_spec(**kw: Any) -> pool_spec.SidecarSpec:
    return pool_spec.SidecarSpec.from_pool(pool(**kw), default_image="img:1")


def pod(*containers: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns1", "labels": {pool_spec.POOL_LABEL: "llama"}, **meta},
            "spec": {"containers": list(containers)}}


def vllm(args: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "vllm", "image": "vllm/vllm-openai:v0.34.0", "command": ["vllm"],
            "args": args if args is not None else ["serve", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", KTC],
            **extra}


def inject(p: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """``p`` after the webhook's patch for the pool ``llama`` with ``spec.sidecar`` = ``kw``."""
    ops = pods.pod_patch(p, pool(), fingerprint="abcd" * 4, sidecar=sidecar_spec(**kw))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(p))


def inject_into(body: dict[str, Any], p: dict[str, Any], *, validate: bool = False) -> dict[str, Any]:
    """``p`` after the webhook's patch for the pool ``body``; with ``validate``, checked against
    the Kubernetes schemas."""
    spec = pool_spec.SidecarSpec.from_pool(body, default_image="img:1")
    out = jsonpatch.JsonPatch(pods.pod_patch(p, body, fingerprint="f" * 16, sidecar=spec)).apply(copy.deepcopy(p))
    if validate:
        kubernetes_validate.validate(out, K8S, strict=True)
    return out


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """A container's env by name (valueFrom where there is no value); no name may repeat."""
    names = [e["name"] for e in c.get("env") or []]
    assert len(names) == len(set(names)), f"repeated env names: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}


def injected_env(spec: pool_spec.SidecarSpec) -> dict[str, str]:
    """The literal environment variables the webhook injects into the sidecar, less the ones
    LocalPool passes as flags (host and ports)."""
    return {e["name"]: e["value"] for e in pods.sidecar_env(spec, pool_name="llama") if "value" in e
            and not e["name"].startswith("VLLM_P2P_")}


def assert_ucx_sidecars_share_chunks(env: dict[str, str]) -> None:
    """Two real ucx sidecar processes with ``env``: chunks stored on one load, byte for byte, on the other."""
    from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
    from kv_offload_testing.local_pool import LocalPool, example_config

    chunk = example_config().kv_bytes_per_chunk
    with LocalPool(2, transport="ucx", capacity_bytes=64 * chunk, env=env) as pool:
        assert share_through_pool(pool, chunk_keys("injected-env", 4), chunk, timeout=10.0) == (4, 0)
        assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") == 4 * chunk
