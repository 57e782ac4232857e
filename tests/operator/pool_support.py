"""Shared pieces of the operator's pure tests (no cluster): pool and pod bodies, injection."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
from kv_offload_operator import pod_patch as pods
from kv_offload_operator import pool_spec
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
    return {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "command": ["vllm"],
            "args": args if args is not None else ["serve", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", KTC],
            **extra}


def inject(p: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """``p`` after the webhook's patch for the pool ``llama`` with ``spec.sidecar`` = ``kw``."""
    ops = pods.pod_patch(p, pool(), fingerprint="abcd" * 4, sidecar=sidecar_spec(**kw))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(p))


def inject_into(body: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """``p`` after the webhook's patch for the pool ``body``."""
    spec = pool_spec.SidecarSpec.from_pool(body, default_image="img:1")
    return jsonpatch.JsonPatch(pods.pod_patch(p, body, fingerprint="f" * 16, sidecar=spec)).apply(copy.deepcopy(p))


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """A container's env by name (valueFrom where there is no value); no name may repeat."""
    names = [e["name"] for e in c.get("env") or []]
    assert len(names) == len(set(names)), f"repeated env names: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}
