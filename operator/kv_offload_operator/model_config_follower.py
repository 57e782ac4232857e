"""Follow the model ConfigMaps pools name in ``spec.modelConfigRef``: an edit is translated again.

``track`` (fed by an ``on.event`` handler) remembers which pools have a
``modelConfigRef``; ``follow`` (a task started at startup) re-reads each
one's ConfigMap every ``--model-config-check-seconds`` and reconciles the
pool again when the content digest differs from ``status.modelConfigDigest``,
so an edited model config reaches the pool's ConfigMap and fingerprint
without a spec change or an operator restart. Not a kopf timer (it would put
a finalizer on every pool), not a ConfigMap watch (cluster-wide list/watch
on ConfigMaps): one ``get`` of a ConfigMap and of a pool per pool and
interval. A ConfigMap that disappears leaves the pool on its last translation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .kube_api import get_pool, patch_pool_status
from .model_config import content_digest, model_config_text
from .reconcile import reconcile

log = logging.getLogger(__name__)


def track(memo: kopf.Memo, event_type: str | None, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
    """Remember (or forget) the pool ``namespace/name`` as one to follow."""
    key = (namespace, name)
    if event_type == "DELETED" or not spec.get("modelConfigRef"):
        memo.model_config_refs.pop(key, None)
    else:
        memo.model_config_refs[key] = True


async def follow(memo: kopf.Memo) -> None:
    """Re-check every tracked pool each ``model_config_check_seconds``, until cancelled."""
    interval = memo.options.model_config_check_seconds
    while True:
        await asyncio.sleep(interval)
        for namespace, name in list(memo.model_config_refs):
            try:
                await _recheck(memo, namespace, name)
            except asyncio.CancelledError:
                raise
            except Exception:  # one pool's API trouble must not stop the others
                log.exception(f"Pool {namespace}/{name}: re-reading its model config failed")


async def _recheck(memo: kopf.Memo, namespace: str, name: str) -> None:
    api: k8s.ApiClient = memo.api
    try:
        body = await get_pool(api, namespace, name)
    except ApiException as exc:
        if exc.status == 404:
            memo.model_config_refs.pop((namespace, name), None)
            return
        raise
    spec, status = body.get("spec") or {}, body.get("status") or {}
    if not spec.get("modelConfigRef"):
        return
    try:
        text = await model_config_text(api, namespace, spec)
    except (ValueError, kopf.TemporaryError):
        return  # gone or keyless: the pool keeps its last translation (running pods are unaffected)
    if content_digest(text) == status.get("modelConfigDigest"):
        return
    log.info(f"Pool {namespace}/{name}: its modelConfigRef ConfigMap changed; translating again.")
    patch = kopf.Patch()
    try:
        await reconcile(body, body.get("metadata") or {}, status, name, namespace, patch, memo, log,
                        memo.ready_counts.get((namespace, name), 0))
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        log.warning(f"Pool {namespace}/{name}: {exc}")
    if patch.status:
        await patch_pool_status(api, namespace, name, patch.status)
