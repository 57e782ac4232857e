"""Shared set-up for the operator tests: the emulated cluster and what they put in it.

``KubernetesEmulator`` (the ``kmock`` fixture) plays the API server over HTTP;
``operator_process.OperatorProcess`` runs ``kv-offload operator`` as a separate
process against it through a kubeconfig, exactly as in a cluster. Nothing is patched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kmock
from operator_process import NAMESPACE
# Re-exported: a few tests still import the process, its certificate and the wait from here.
from operator_process import KV_OFFLOAD, OperatorProcess, make_tls  # noqa: F401
from waiting import wait_for_async as wait_for  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures_operator"
POOLS = "kv-offload.io/v1alpha1/kvoffloadpools"
POOLS_URL = f"/apis/kv-offload.io/v1alpha1/namespaces/{NAMESPACE}/kvoffloadpools"
KTC = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 10737418240}},
                 separators=(",", ":"))
LLAMA_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16",
              "--kv-transfer-config", KTC]


def llama_config() -> dict[str, Any]:
    return json.loads((FIXTURES / "llama-3.1-8b-config.json").read_text())


PEERINGS = "kopf.dev/v1/kopfpeerings"
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def emulate_cluster(k: kmock.KubernetesEmulator) -> None:
    """Declare what discovery must show: our CRD, the core kinds, namespaces, CRDs and kopf's
    peering kinds (the chart installs them; only operators run with --peering use them)."""
    verbs = {"list", "watch", "get", "patch", "create", "delete"}
    k.resources[PEERINGS] = kmock.ResourceInfo(kind="KopfPeering", namespaced=True, verbs=verbs)
    k.resources[CLUSTER_PEERINGS] = kmock.ResourceInfo(kind="ClusterKopfPeering", namespaced=False, verbs=verbs)
    k.resources[POOLS] = kmock.ResourceInfo(kind="KVOffloadPool", namespaced=True, verbs=verbs,
                                            subresources={"status"})
    for plural, kind in (("pods", "Pod"), ("configmaps", "ConfigMap"), ("secrets", "Secret"),
                         ("services", "Service"), ("events", "Event")):
        k.resources[f"v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)
    for plural, kind in (("deployments", "Deployment"), ("statefulsets", "StatefulSet")):
        k.resources[f"apps/v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)
    k.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs=verbs)
    k.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs)


def pool_body(name: str, *, vllm_args: Sequence[str] = LLAMA_ARGS, uid: str | None = None,
              model_config: Mapping[str, Any] | None = None, generation: int = 1,
              sidecar: Mapping[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"vllmArgs": list(vllm_args),
                            "modelConfig": dict(model_config or llama_config())}
    if sidecar:
        spec["sidecar"] = dict(sidecar)
    return {"apiVersion": "kv-offload.io/v1alpha1", "kind": "KVOffloadPool",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid or f"uid-{name}",
                         "generation": generation},
            "spec": spec}


async def create(k: kmock.KubernetesEmulator, url: str, body: Mapping[str, Any]) -> None:
    resp = await k.post(url, json=body)
    assert resp.status == 200, await resp.text()


async def merge_patch(k: kmock.KubernetesEmulator, url: str, body: Mapping[str, Any]) -> None:
    resp = await k.patch(url, json=body, headers={"Content-Type": "application/merge-patch+json"})
    assert resp.status == 200, await resp.text()


def obj(k: kmock.KubernetesEmulator, resource: str, name: str,
        namespace: str = NAMESPACE) -> dict[str, Any] | None:
    """The stored object as a plain dict, or None."""
    key = (kmock.resource(resource), namespace, name)
    if key not in k.objects or k.objects[key].deleted:
        return None
    return json.loads(json.dumps(dict(k.objects[key].raw)))


def requests_to(k: kmock.KubernetesEmulator, method: str) -> list[kmock.Request]:
    return [r for r in list(k) if str(r.method.value).upper() == method.upper()]


def assert_within_rbac(k: kmock.KubernetesEmulator) -> None:
    """Every API request the operator made is allowed by rbac.OPERATOR_RBAC."""
    from kv_offload_operator.rbac import OPERATOR_RBAC

    verbs = {"list": "list", "watch": "watch", "fetch": "get", "create": "create", "delete": "delete"}
    used: set[tuple[str, str, str]] = set()
    for req in list(k):
        if req.resource is None or not req.resource.plural or req.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # discovery, or the test's own requests
        action = str(req.action.value).lower() if req.action is not None else ""
        verb = {"PATCH": "patch", "PUT": "update"}.get(str(req.method.value).upper()) or verbs.get(action, action)
        plural = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        used.add((req.resource.group or "", plural, verb))
    outside = sorted(u for u in used if u[2] not in OPERATOR_RBAC.get((u[0], u[1]), ()))
    assert not outside, f"requests outside OPERATOR_RBAC: {outside}"
