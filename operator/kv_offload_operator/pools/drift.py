"""Hand edits of a pool's ConfigMap and Secret, reverted within seconds (not at the next reconcile).

The operator watches the ConfigMaps it labels ``app.kubernetes.io/managed-by:
kv-offload`` (``handlers``; a label-selected watch). ``reconcile`` records,
before each write, the data it wants in each pool's ConfigMap (``remember``);
an event showing other data (an edited, added or removed key) is patched
back to it, and a ConfigMap deleted while its pool exists is created again.
Each revert is counted in ``kv_offload_operator_drift_reverted_total{kind}``,
logged and posted as a Warning Event ``ConfigMapReverted`` on the pool: the
pool's spec, not its ConfigMap, is what to edit. Only the replica that
reconciles reverts (``memo.leading``), and only what it has written since it
started (every pool is reconciled at start). A sidecar reads its ConfigMap
when it starts, so a reverted edit reaches no sidecar unless one restarts in
those seconds; what a sidecar does with a config it cannot use is the
sidecar's.

The pool Secret is never listed or watched (the chart does not let the
operator): ``pool_key`` records what it writes or first finds complete and, every
``--drift-check-seconds``, reads each pool's Secret back and reverts an edit the
same way (``kind="Secret"``, Event ``SecretReverted``; the message names keys,
never values). ``report`` and ``pool_alive`` are shared by both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from ..kube_api import MERGE_PATCH, create_unless_exists
from .pool_api import get_pool
from .pool_objects import configmap_name
from .pool_spec import GROUP, KIND, VERSION

log = logging.getLogger(__name__)

# The label (on every child the operator writes) whose ConfigMaps the drift watch sees.
MANAGED_BY = {"app.kubernetes.io/managed-by": "kv-offload"}


def remember(memo: kopf.Memo, configmap: Mapping[str, Any]) -> None:
    """Record ``configmap`` (as ``pool_objects.configmap_for`` builds it) as what its pool wants."""
    meta = configmap["metadata"]
    memo.written_configmaps[(meta["namespace"], meta["name"])] = configmap


def forget_pool(memo: kopf.Memo, namespace: str, pool_name: str) -> None:
    """Drop what a deleted pool's ConfigMap and Secret were to hold: their deletion is not drift."""
    memo.written_configmaps.pop((namespace, configmap_name(pool_name)), None)
    memo.written_secrets.pop((namespace, pool_name), None)


def changed_keys(have: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ (edited, added or removed), sorted."""
    return sorted(k for k in {*have, *wanted} if have.get(k) != wanted.get(k))


async def check_configmap(memo: kopf.Memo, event_type: str | None, body: Mapping[str, Any]) -> None:
    """Revert a ConfigMap the operator wrote when ``body`` (a watch event's object) differs from it."""
    meta = body.get("metadata") or {}
    key = (meta.get("namespace"), meta.get("name"))
    wanted = memo.written_configmaps.get(key)
    if wanted is None or not memo.leading:
        return
    namespace, name = key
    core = k8s.CoreV1Api(memo.api)
    pool_name = wanted["metadata"]["ownerReferences"][0]["name"]
    if event_type == "DELETED":
        if not await pool_alive(memo, namespace, pool_name):
            forget_pool(memo, namespace, pool_name)
            return
        await create_unless_exists(core.create_namespaced_config_map, namespace, wanted)
        what = "was deleted; created again"
    else:
        have = dict(body.get("data") or {})
        if have == wanted["data"]:
            return
        changed = changed_keys(have, wanted["data"])
        undo = {k: wanted["data"].get(k) for k in changed}  # None removes a key added by hand
        await core.patch_namespaced_config_map(name, namespace, {"data": undo}, _content_type=MERGE_PATCH)
        what = f"was edited by hand (keys {', '.join(changed)}); reverted"
    report(memo, "ConfigMap", f"{namespace}/{name}", what, wanted["metadata"]["ownerReferences"][0], namespace,
           "to the pool's translation: edit the KVOffloadPool's spec instead")


def report(memo: kopf.Memo, kind: str, where: str, what: str, owner: Mapping[str, Any], namespace: str,
           advice: str) -> None:
    """Count, log and post (a Warning Event ``<kind>Reverted`` on the owning pool) one revert."""
    memo.metrics.drift_reverted.labels(kind=kind).inc()
    message = f"{kind} {where} {what} {advice}."
    log.warning(message)
    pool_ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                "metadata": {"name": owner["name"], "namespace": namespace, "uid": owner["uid"]}}
    try:
        kopf.warn(pool_ref, reason=f"{kind}Reverted", message=message)
    except LookupError:  # outside kopf's tasks (no event poster): the log line says it
        pass


async def pool_alive(memo: kopf.Memo, namespace: str, pool_name: str) -> bool:
    """Whether the pool exists and is not being deleted (a child deleted with it is no drift)."""
    try:
        pool = await get_pool(memo.api, namespace, pool_name)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return not (pool.get("metadata") or {}).get("deletionTimestamp")
