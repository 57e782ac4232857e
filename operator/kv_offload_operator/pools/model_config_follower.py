"""Follow what pools read outside their spec: an edit is translated again.

The model ConfigMap of ``spec.modelConfigRef`` and the workload of
``spec.targetRef`` (a Deployment, StatefulSet or LeaderWorkerSet whose vLLM
container the pool translates, ``pool_source``). ``track`` (fed by an
``on.event`` handler) remembers which pools name either; ``follow`` (a task
started at startup) re-reads them every ``--model-config-check-seconds`` and
reconciles the pool again when the ConfigMap's content digest differs from
``status.modelConfigDigest`` or the workload's pod-template digest from
``status.workloadDigest``, so an edited model config or a changed vLLM
command line reaches the pool's ConfigMap and fingerprint without a spec
change or an operator restart. Not a kopf timer (it would put a finalizer on
every pool), not a ConfigMap or workload watch (cluster-wide list/watch on
ConfigMaps and Deployments): one ``get`` of each named object and of the pool
per pool and interval. A ConfigMap or workload that disappears leaves the
pool on its last translation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s

from .model_config import content_digest, model_config_text
from . import pool_api
from .pool_api import patch_pool_status
from .pool_source import read_workload, template_digest
from .reconcile import reconcile

log = logging.getLogger(__name__)


def track(memo: kopf.Memo, event_type: str | None, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
    """Remember (or forget) the pool ``namespace/name`` as one to follow."""
    FOLLOWER.track(memo, event_type, namespace, name, bool(spec.get("modelConfigRef") or spec.get("targetRef")))


async def _recheck(memo: kopf.Memo, namespace: str, name: str, body: dict[str, Any]) -> None:
    api: k8s.ApiClient = memo.api
    spec, status = body.get("spec") or {}, body.get("status") or {}
    changed = await _changed(api, namespace, spec, status)
    if changed is None:
        return
    log.info(f"Pool {namespace}/{name}: its {changed} changed; translating again.")
    patch = kopf.Patch()
    try:
        await reconcile(body, body.get("metadata") or {}, status, name, namespace, patch, memo, log)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        log.warning(f"Pool {namespace}/{name}: {exc}")
    if patch.status:
        await patch_pool_status(api, namespace, name, patch.status)


# Re-checks every tracked pool each ``model_config_check_seconds``, until cancelled.
FOLLOWER = pool_api.PoolFollower("model_config_refs", "model_config_check_seconds", _recheck,
                                 "re-reading its model config or workload")
follow = FOLLOWER.follow


async def _changed(api: k8s.ApiClient, namespace: str, spec: Mapping[str, Any],
                   status: Mapping[str, Any]) -> str | None:
    """What changed since the last translation ("modelConfigRef ConfigMap", "targetRef
    workload"), or None. One that is gone (or keyless) changes nothing: the pool keeps its
    last translation and running pods are unaffected."""
    if spec.get("modelConfigRef"):
        try:
            text = await model_config_text(api, namespace, spec)
        except (ValueError, kopf.TemporaryError):
            text = None
        if text is not None and content_digest(text) != status.get("modelConfigDigest"):
            return "modelConfigRef ConfigMap"
    if spec.get("targetRef"):
        try:
            read = await read_workload(api, namespace, spec)
        except (ValueError, kopf.TemporaryError):
            read = None
        if read is not None and template_digest(read[0], read[2]) != status.get("workloadDigest"):
            return "targetRef workload"
    return None
