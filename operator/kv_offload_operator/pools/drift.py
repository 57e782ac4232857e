"""Hand edits of a pool's ConfigMap, reverted within seconds of the edit (not at the next reconcile).

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
sidecar's. The pool Secret is not watched (the chart never lets the operator
list or watch Secrets).
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
# The Event reason posted on the pool when its ConfigMap is reverted.
REVERTED = "ConfigMapReverted"


def remember(memo: kopf.Memo, configmap: Mapping[str, Any]) -> None:
    """Record ``configmap`` (as ``pool_objects.configmap_for`` builds it) as what its pool wants."""
    meta = configmap["metadata"]
    memo.written_configmaps[(meta["namespace"], meta["name"])] = configmap


def forget_pool(memo: kopf.Memo, namespace: str, pool_name: str) -> None:
    """Drop what a deleted pool's ConfigMap was to hold: its deletion is not drift."""
    memo.written_configmaps.pop((namespace, configmap_name(pool_name)), None)


async def check_configmap(memo: kopf.Memo, event_type: str | None, body: Mapping[str, Any]) -> None:
    """Revert a ConfigMap the operator wrote when ``body`` (a watch event's object) differs from it."""
    meta = body.get("metadata") or {}
    key = (meta.get("namespace"), meta.get("name"))
    wanted = memo.written_configmaps.get(key)
    if wanted is None or not memo.leading:
        return
    namespace, name = key
    core = k8s.CoreV1Api(memo.api)
    if event_type == "DELETED":
        if not await _pool_alive(memo, wanted):
            forget_pool(memo, namespace, wanted["metadata"]["ownerReferences"][0]["name"])
            return
        await create_unless_exists(core.create_namespaced_config_map, namespace, wanted)
        what = "was deleted; created again"
    else:
        have = dict(body.get("data") or {})
        if have == wanted["data"]:
            return
        changed = sorted(k for k in {*have, *wanted["data"]} if have.get(k) != wanted["data"].get(k))
        undo = {k: wanted["data"].get(k) for k in changed}  # None removes a key added by hand
        await core.patch_namespaced_config_map(name, namespace, {"data": undo}, _content_type=MERGE_PATCH)
        what = f"was edited by hand (keys {', '.join(changed)}); reverted"
    memo.metrics.drift_reverted.labels(kind="ConfigMap").inc()
    message = (f"ConfigMap {namespace}/{name} {what} to the pool's translation: edit the KVOffloadPool's "
               f"spec instead.")
    log.warning(message)
    try:
        kopf.warn(_pool_ref(wanted), reason=REVERTED, message=message)
    except LookupError:  # outside kopf's tasks (no event poster): the log line says it
        pass


async def _pool_alive(memo: kopf.Memo, configmap: Mapping[str, Any]) -> bool:
    """Whether the ConfigMap's pool exists and is not being deleted."""
    meta = configmap["metadata"]
    try:
        pool = await get_pool(memo.api, meta["namespace"], meta["ownerReferences"][0]["name"])
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return not (pool.get("metadata") or {}).get("deletionTimestamp")


def _pool_ref(configmap: Mapping[str, Any]) -> dict[str, Any]:
    """The owning pool, as much of it as an Event's involvedObject needs."""
    owner = configmap["metadata"]["ownerReferences"][0]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": owner["name"], "namespace": configmap["metadata"]["namespace"],
                         "uid": owner["uid"]}}
