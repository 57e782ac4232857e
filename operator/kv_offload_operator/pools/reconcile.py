"""One pool reconciliation: translate the pool, write its ConfigMap, Secret and Service, set its status.

The command line comes from ``spec.vllmArgs`` or the ``spec.targetRef``
workload (``pool_source``). The ConfigMap holds ``pool_config`` (the pool's
OffloadingConfig, with no engine's own values: every pod mounts it); the Secret is created once and
completed when an older operator wrote it (``pool_key.ensure``; only a
requested rotation changes its key, ``pool_key.follow``); the Service ports
follow the pool's DP size. The status (fingerprint, namespace digest,
the declared model identity, ConfigMap name, conditions; ``readyPeers`` 0 until the ready-peers follower
counts) goes to ``patch.status`` also when the reconciliation fails, so a
pool that can never work shows ``Invalid`` with the translator's message.
``status.translatedBy`` names the operator that translated it; an unchanged
spec that now translates to another fingerprint is announced (a Warning Event
and a condition) before the new ConfigMap is written (``translation_change``). A
pinned ``spec.sidecar.image`` outside the releases this operator drives makes the
pool Invalid (``sidecar_image``; its ``SidecarImage`` condition says which).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s

from . import drift, pool_key
from . import pool_objects as objects
from . import sidecar_image, translation_change
from ..kube_api import MERGE_PATCH, create_unless_exists, read_or_none
from .model_config import model_config
from .pool_source import source_release, vllm_source
from .pool_spec import (
    PoolSpecError,
    SidecarSpec,
    deprecation_conditions,
    key_rotation_grace_seconds,
    pool_hash_seed_problem,
)
from ..translation.declared_identity import declared_identity, status_text
from ..translation.translate import TranslationError, pool_config

log = logging.getLogger(__name__)


async def reconcile(body: Mapping[str, Any], meta: Mapping[str, Any], status: Mapping[str, Any],
                    name: str, namespace: str, patch: kopf.Patch, memo: kopf.Memo,
                    logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Translate the pool and write its children; the status goes to ``patch.status``
    (also when it raises: PermanentError for a spec that can never work, TemporaryError
    while something it needs does not exist yet). ``status.readyPeers`` is the ready-peers
    follower's (``ready_peers``); a pool that shows none yet gets 0 here.
    Counted in ``memo.metrics.reconciles``."""
    try:
        await _reconcile(body, meta, status, name, namespace, patch, memo, logger)
    except kopf.PermanentError:
        memo.metrics.reconciles.labels(result="invalid").inc()
        raise
    except kopf.TemporaryError:
        memo.metrics.reconciles.labels(result="waiting").inc()
        raise
    except Exception:
        memo.metrics.reconciles.labels(result="error").inc()
        raise
    memo.metrics.reconciles.labels(result="ok").inc()


async def _reconcile(body: Mapping[str, Any], meta: Mapping[str, Any], status: Mapping[str, Any],
                     name: str, namespace: str, patch: kopf.Patch, memo: kopf.Memo,
                     logger: logging.Logger | logging.LoggerAdapter) -> None:
    api: k8s.ApiClient = memo.api
    generation = meta.get("generation")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    pool = json.loads(json.dumps(dict(body)))

    image = sidecar_image.check(pool["spec"])
    image_condition = sidecar_image.image_conditions(status.get("conditions"), image, generation, now)

    def waiting(exc: kopf.TemporaryError) -> None:
        patch.status["conditions"] = objects.pool_conditions(
            status.get("conditions"), invalid_message=None, waiting_message=str(exc),
            generation=generation, now=now) + image_condition

    try:
        model = await model_config(api, namespace, pool["spec"], patch)
        source = await vllm_source(api, namespace, pool["spec"], patch)
        release, release_source = source_release(source, pool["spec"])
        config = pool_config(list(source.argv), model, env=source.env,
                             vllm_version=release.version, accelerators=source.accelerators)
        declared = declared_identity(list(source.argv), model)
        sidecar = SidecarSpec.with_operator_defaults(pool, memo.options)
        if image.refused:  # its pods are denied with this sentence, not started to crash-loop
            _warn(pool, sidecar_image.REFUSED_EVENT, image.message)
            raise PoolSpecError(image.message)
        seed_problem = pool_hash_seed_problem(config, sidecar.hash_seed)
        if seed_problem is not None:
            raise PoolSpecError(seed_problem)
        key_rotation_grace_seconds(pool)
        ports = objects.pool_ports(config, sidecar)
    except ValueError as exc:  # TranslationError, PoolSpecError, bad sidecar values, ports or grace
        if isinstance(exc, TranslationError):
            memo.metrics.translation_errors.inc()
        message = str(exc)
        patch.status["conditions"] = objects.pool_conditions(
            status.get("conditions"), invalid_message=message, generation=generation, now=now) + image_condition
        patch.status["observedGeneration"] = generation
        raise kopf.PermanentError(message) from None
    except kopf.TemporaryError as exc:  # e.g. the modelConfigRef ConfigMap does not exist yet
        waiting(exc)
        raise

    digests = {key: patch.status.get(key) for key in ("modelConfigDigest", "workloadDigest")}
    changed = translation_change.fingerprint_change(status, generation, config.fingerprint, digests)
    if changed is not None:  # said before the ConfigMap the restarted sidecars read changes
        log.warning(f"Pool {namespace}/{name}: {changed}")
        _warn(pool, translation_change.CONDITION, changed)

    core = k8s.CoreV1Api(api)
    configmap = objects.configmap_for(pool, config, declared)
    drift.remember(memo, configmap)  # before the write: its own watch event is no drift
    await _ensure_configmap(core, configmap)
    try:
        await pool_key.ensure(memo, pool)
    except kopf.TemporaryError as exc:
        waiting(exc)
        raise
    await _ensure_service(core, objects.peers_service(pool, ports))

    if status.get("readyPeers") is None:  # counted by ready_peers.follow from the next check on
        patch.status["readyPeers"] = 0
    patch.status["fingerprint"] = config.fingerprint
    patch.status["namespaceDigest"] = config.namespace_digest
    patch.status["declaredModelIdentity"] = status_text(declared)
    patch.status["vllmVersion"] = f"{release.version} (from {release_source})"
    patch.status["configMap"] = objects.configmap_name(name)
    patch.status["observedGeneration"] = generation
    patch.status["translatedBy"] = translation_change.TRANSLATED_BY
    patch.status["conditions"] = objects.pool_conditions(
        status.get("conditions"), invalid_message=None, generation=generation, now=now
    ) + translation_change.change_conditions(status.get("conditions"), changed, generation, now) \
        + deprecation_conditions(sidecar, status.get("conditions"), generation, now) + image_condition
    logger.info(f"Pool {namespace}/{name}: fingerprint {config.fingerprint}, "
                f"ConfigMap {objects.configmap_name(name)} written "
                f"(vLLM {release.version}'s rules, from {release_source}).")


async def _ensure_configmap(core: k8s.CoreV1Api, cm: Mapping[str, Any]) -> None:
    meta = cm["metadata"]
    current = await read_or_none(core.read_namespaced_config_map, meta["name"], meta["namespace"])
    if current is None:
        await create_unless_exists(core.create_namespaced_config_map, meta["namespace"], cm)
    elif (current.data or {}) != cm["data"]:
        added = {key: None for key in current.data or {} if key not in cm["data"]}  # None: merge-patch removes
        await core.patch_namespaced_config_map(
            meta["name"], meta["namespace"],
            {"data": {**added, **cm["data"]}, "metadata": {"ownerReferences": meta["ownerReferences"]}},
            _content_type=MERGE_PATCH)


async def _ensure_service(core: k8s.CoreV1Api, svc: Mapping[str, Any]) -> None:
    meta = svc["metadata"]
    current = await read_or_none(core.read_namespaced_service, meta["name"], meta["namespace"])
    if current is None:
        await create_unless_exists(core.create_namespaced_service, meta["namespace"], svc)
        return
    have = core.api_client.sanitize_for_serialization(current.spec) or {}
    want = svc["spec"]
    have_ports = [{k: p.get(k) for k in ("name", "port", "targetPort")} for p in have.get("ports") or []]
    want_ports = [{k: p.get(k) for k in ("name", "port", "targetPort")} for p in want["ports"]]
    if have.get("selector") != want["selector"] or have_ports != want_ports:
        await core.patch_namespaced_service(
            meta["name"], meta["namespace"],
            {"spec": {"selector": want["selector"], "ports": want["ports"]}}, _content_type=MERGE_PATCH)


def _warn(pool: Mapping[str, Any], reason: str, message: str) -> None:
    """A Warning Event on the pool (outside kopf's tasks, with no event poster: none; the
    caller's log line and condition say it)."""
    try:
        kopf.warn(pool, reason=reason, message=message)
    except LookupError:
        pass
