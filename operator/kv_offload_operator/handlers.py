"""The kopf handlers of the kv-offload operator: registrations only.

Importing this module registers them in kopf's default registry. Each
handler's name is its id (in progress annotations, logs and the webhook
path ``/inject_sidecar``), and each hands its work to the module named for it:
``startup`` (settings, webhook server, API client, followers), ``ready_peers``
(the pod and pool indexes its follower reads),
``reconcile`` (a pool's ConfigMap, Secret, Service and status),
``model_config_follower``, ``pool_key`` (key rotation), ``drift`` (hand edits of a
pool's ConfigMap; its Secret is ``pool_key``'s) and ``webhook.admission``
(admission of a pod).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from . import startup
from .pools import drift, model_config_follower, pool_key, ready_peers
from .pools.pool_spec import GROUP, PLURAL, POOL_LABEL, VERSION
from .pools.reconcile import reconcile
from .webhook import admission
from .webhook.pod_patch import apply_patch


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
                    pool_sidecars: kopf.Index, pool_peer_status: kopf.Index, **_: Any) -> None:
    """All operator settings, the webhook server, the API client and the followers, in one place."""
    await startup.configure(settings, memo, logger, pool_sidecars=pool_sidecars, pools=pool_peer_status)


@kopf.on.cleanup()
async def shut_down(memo: kopf.Memo, **_: Any) -> None:
    """Stop the followers, close the API client, delete a self-signed dev key."""
    await startup.shut_down(memo)


@kopf.index("pods", labels={POOL_LABEL: kopf.PRESENT}, when=ready_peers.sidecar_is_running)
def pool_sidecars(namespace: str, name: str, labels: Mapping[str, str], annotations: Mapping[str, str],
                  spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict[tuple[str, str], Any]:
    """Each pool pod whose sidecar runs (pod IP, kvo-metrics port, injected fingerprint), by
    (namespace, pool name): the sidecars the ready-peers follower asks."""
    return {(namespace, labels[POOL_LABEL]): ready_peers.sidecar_endpoint(name, annotations, spec, status)}


@kopf.index(GROUP, VERSION, PLURAL)
def pool_peer_status(namespace: str, name: str, status: kopf.Status, **_: Any) -> dict[tuple[str, str], Any]:
    """Each pool's current fingerprint and the ready peers its status shows, by (namespace, pool name)."""
    return {(namespace, name): ready_peers.pool_peer_status(status)}


@kopf.index(GROUP, VERSION, PLURAL)
def pool_bodies(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    """Each pool as last watched, by (namespace, pool name): what the webhook reads instead of
    the API on the replica that reconciles (``admission``)."""
    return {(namespace, name): admission.watched_pool(body)}


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile_pool(body: kopf.Body, meta: kopf.Meta, status: kopf.Status,
                         name: str, namespace: str, patch: kopf.Patch, memo: kopf.Memo,
                         logger: logging.Logger, **_: Any) -> None:
    """Translate the pool and write its ConfigMap, Secret, Service and status."""
    await reconcile(body, meta, status, name, namespace, patch, memo, logger)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track_model_config_refs(event: kopf.RawEvent, namespace: str, name: str, spec: kopf.Spec,
                                  memo: kopf.Memo, **_: Any) -> None:
    """Remember which pools read their model config from a ConfigMap or their command line
    from a workload (spec.targetRef), for the follower."""
    model_config_follower.track(memo, event.get("type"), namespace, name, spec)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track_key_rotations(event: kopf.RawEvent, namespace: str, name: str, annotations: kopf.Annotations,
                              status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
    """Remember which pools ask for a pool key rotation or roll one out (for the follower)."""
    pool_key.track(memo, event.get("type"), namespace, name, annotations, status)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track_pool_conditions(event: kopf.RawEvent, namespace: str, name: str, status: kopf.Status,
                                memo: kopf.Memo, **_: Any) -> None:
    """Count pools by the condition their status shows (the ``kv_offload_operator_pools`` gauge);
    a deleted pool's ConfigMap is no longer kept (``drift``)."""
    memo.metrics.track_pool(namespace, name, status, deleted=event.get("type") == "DELETED")
    if event.get("type") == "DELETED":
        drift.forget_pool(memo, namespace, name)


@kopf.on.event("configmaps", labels=drift.MANAGED_BY)
async def revert_configmap_drift(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Revert a hand edit of a pool's ConfigMap within seconds of it (``drift``)."""
    await drift.check_configmap(memo, event.get("type"), body)


@kopf.on.mutate("pods", labels={POOL_LABEL: kopf.PRESENT}, operations={"CREATE"})
async def inject_sidecar(body: kopf.Body, labels: Mapping[str, str], namespace: str | None,
                         patch: kopf.Patch, memo: kopf.Memo, pool_bodies: kopf.Index, **_: Any) -> None:
    """Wire a labelled pod into its pool; deny it when the pool is missing or Invalid."""
    pod = json.loads(json.dumps(dict(body)))
    namespace = namespace or "default"
    watched = next(iter(pool_bodies.get((namespace, labels[POOL_LABEL]), ())), None)
    ops = await admission.answer(pod, labels[POOL_LABEL], namespace, memo, watched)
    if ops:
        patch.fns.append(lambda raw: apply_patch(raw, ops))
