"""Where a pool's vLLM command line comes from: ``spec.vllmArgs``, or the workload ``spec.targetRef`` names.

``vllm_source(api, namespace, spec)`` gives the command line and env the
pool's pods run, as the translator and the webhook read them: with
``spec.targetRef`` the workload's pod template is read (one ``get``; a
LeaderWorkerSet's leaderTemplate, else its workerTemplate) and its vLLM
container found the way the webhook finds it in a pod
(``pool_pod.find_vllm_container``: the container running vllm, or the one
the template's ``kv-offload.io/vllm-container`` annotation names); with
``spec.injectKVTransferConfig`` a command line without
``--kv-transfer-config`` gets ours (``kv_transfer``). Nothing is copied into
the spec: ``status.workloadDigest`` (the digest of what was read) tells the
follower when to translate again. A workload that does not exist (yet) is a
``kopf.TemporaryError`` (the pool waits, Ready=False with the reason); one
without a usable vLLM container is a ``PoolSpecError``.

``source_release(source, spec)``: the vLLM release the pool's pods run, whose
rules the translation follows: the vLLM container's image tag when it names a
release, else ``spec.vllmVersion``, else the newest supported release.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from . import kv_transfer
from .pool_pod import container_accelerators, container_argv, find_vllm_container
from .pool_spec import PoolSpecError
from ..translation.vllm_releases import VllmRelease, pool_release

# (apiVersion, kind) -> (group, version, plural) of the workloads spec.targetRef may name.
WORKLOAD_KINDS: Mapping[tuple[str, str], tuple[str, str, str]] = {
    ("apps/v1", "Deployment"): ("apps", "v1", "deployments"),
    ("apps/v1", "StatefulSet"): ("apps", "v1", "statefulsets"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
}


@dataclass(frozen=True)
class VllmSource:
    """The vLLM command line and env a pool's pods run."""

    # The command line as the pods run it (our --kv-transfer-config added when injected).
    argv: tuple[str, ...]
    # Plain env values of the workload's vLLM container ({} for spec.vllmArgs).
    env: Mapping[str, str] = field(default_factory=dict)
    # Digest of the workload's pod template (status.workloadDigest, ``template_digest``); None for vllmArgs.
    digest: str | None = None
    # Where the command line was read, for messages: "spec.vllmArgs" or "Deployment 'llama' container 'vllm'".
    where: str = "spec.vllmArgs"
    # The vLLM container's image (None for spec.vllmArgs): its tag may name the vLLM release.
    image: str | None = None
    # Accelerators the vLLM container's resources ask for (``ACCELERATOR_RESOURCES``; None: it
    # names none, or spec.vllmArgs): one node's share, which no engine's workers may exceed.
    accelerators: int | None = None


def workload_ref(spec: Mapping[str, Any]) -> tuple[tuple[str, str, str], str, str] | None:
    """((group, version, plural), kind, name) of spec.targetRef; None without one.

    PoolSpecError naming the value when it names a kind the operator cannot read."""
    ref = spec.get("targetRef")
    if ref is None:
        return None
    if not isinstance(ref, Mapping) or not ref.get("name"):
        raise PoolSpecError(f"spec.targetRef={ref!r} needs apiVersion, kind and name, e.g. "
                            f"{{apiVersion: apps/v1, kind: Deployment, name: llama}}")
    key = (str(ref.get("apiVersion")), str(ref.get("kind")))
    if key not in WORKLOAD_KINDS:
        choices = ", ".join(f"{v} {k}" for v, k in WORKLOAD_KINDS)
        raise PoolSpecError(f"spec.targetRef names {key[0]} {key[1]} {ref['name']!r}: the operator reads {choices}")
    return WORKLOAD_KINDS[key], key[1], str(ref["name"])


def pod_template(kind: str, workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """The workload's pod template (metadata + spec): a LeaderWorkerSet's leader template
    when it has one (the pod running the vLLM server), else its worker template."""
    spec = workload.get("spec") or {}
    if kind == "LeaderWorkerSet":
        lws = spec.get("leaderWorkerTemplate") or {}
        return lws.get("leaderTemplate") or lws.get("workerTemplate") or {}
    return spec.get("template") or {}


def template_digest(kind: str, workload: Mapping[str, Any]) -> str:
    """Digest of what the translation reads from a workload: its pod template's containers
    and annotations (``status.workloadDigest``), also when they hold no usable vLLM container."""
    template = pod_template(kind, workload)
    read = {"containers": (template.get("spec") or {}).get("containers") or [],
            "annotations": (template.get("metadata") or {}).get("annotations") or {}}
    return hashlib.sha256(json.dumps(read, sort_keys=True).encode()).hexdigest()[:16]


def template_source(kind: str, name: str, workload: Mapping[str, Any]) -> VllmSource:
    """The vLLM container of a workload's pod template as a ``VllmSource`` (no injection yet)."""
    template = pod_template(kind, workload)
    try:
        index = find_vllm_container(template)
    except ValueError as exc:
        raise PoolSpecError(f"{kind} {name!r} named by spec.targetRef: {exc} on its pod template") from None
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        raise PoolSpecError(f"{kind} {name!r} named by spec.targetRef has no containers in its pod template")
    container = containers[index]
    argv = tuple(container_argv(container))
    env = {str(e["name"]): str(e["value"]) for e in container.get("env") or [] if "value" in e}
    return VllmSource(argv=argv, env=env, digest=template_digest(kind, workload),
                      where=f"{kind} {name!r} container {container.get('name')!r}",
                      image=container.get("image"), accelerators=container_accelerators(container))


def source_release(source: VllmSource, spec: Mapping[str, Any]) -> tuple[VllmRelease, str]:
    """(the vLLM release the pool's pods run, where that was read): the vLLM container's
    image tag when it names a release, else ``spec.vllmVersion``, else the newest supported.
    PoolSpecError for a release kv-offload does not support."""
    version = spec.get("vllmVersion")
    try:
        return pool_release(source.image, None if version is None else str(version))
    except ValueError as exc:
        where = f"{source.where} image {source.image!r}" if source.image else "spec.vllmVersion"
        raise PoolSpecError(f"{where}: {exc}") from None


async def read_workload(api: k8s.ApiClient, namespace: str,
                        spec: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    """(kind, name, body) of the spec.targetRef workload; None without a targetRef.

    kopf.TemporaryError while it does not exist (or its API is not served)."""
    ref = workload_ref(spec)
    if ref is None:
        return None
    (group, version, plural), kind, name = ref
    try:
        if group == "apps":
            apps = k8s.AppsV1Api(api)
            reader = apps.read_namespaced_deployment if plural == "deployments" else apps.read_namespaced_stateful_set
            body = api.sanitize_for_serialization(await reader(name, namespace))
        else:
            body = await k8s.CustomObjectsApi(api).get_namespaced_custom_object(group, version, namespace, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            raise kopf.TemporaryError(f"{kind} {name!r} named by spec.targetRef does not exist in namespace "
                                      f"{namespace!r}; waiting for it", delay=30) from None
        raise
    return kind, name, body


async def vllm_source(api: k8s.ApiClient, namespace: str, spec: Mapping[str, Any],
                      patch: kopf.Patch | None = None) -> VllmSource:
    """The pool's command line and env as its pods run them (see the module docstring); the
    workload's digest goes to ``patch.status.workloadDigest`` as soon as it is read."""
    connector = kv_transfer.injected_connector(spec)
    read = await read_workload(api, namespace, spec)
    if read is None:
        source = VllmSource(argv=tuple(str(a) for a in spec.get("vllmArgs") or []))
    else:
        if patch is not None:
            patch.status["workloadDigest"] = template_digest(read[0], read[2])
        source = template_source(*read)
    try:
        argv = kv_transfer.effective_argv(source.argv, connector, source.where)
    except ValueError as exc:
        raise PoolSpecError(str(exc)) from None
    return VllmSource(argv=tuple(argv), env=source.env, digest=source.digest, where=source.where,
                      image=source.image, accelerators=source.accelerators)
