"""The pool Secret through the API: created complete, completed once, rotated on request.

``ensure`` (called by ``reconcile``) creates ``<pool>-pool-key`` with a pool
key, a secret hash seed and an admin token, or adds what a Secret written by
an older operator lacks; it never replaces a value. ``track`` (fed by an
``on.event`` handler) remembers the pools that ask for a key rotation or are
rolling one out (``key_rotation.needs_attention``, from the pool body alone);
``follow`` (a task started at startup) runs ``key_rotation.plan`` for each of
them every ``--key-rotation-check-seconds`` and writes the Secret and
``status.keyRotation``. Not a kopf timer, which would put a finalizer on every
pool. Every Secret write of a pool happens under one lock per pool, and a
patch carries the ``resourceVersion`` it was planned from, so two writers
never build on the same old key.

Each Secret this replica writes, or first finds complete, is recorded
(``memo.written_secrets``); ``follow_drift`` (a startup task) reads each back
every ``--drift-check-seconds`` on the leading replica and reverts a hand edit
(an edited, added or removed key; a Secret deleted while its pool exists is
created again with the same values), reported by ``drift.report``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s

from . import drift, key_rotation, pool_api
from . import pool_objects as objects
from ..kube_api import MERGE_PATCH, create_unless_exists, read_or_none
from .pool_api import patch_pool_status
from .pool_spec import key_rotation_grace_seconds

log = logging.getLogger(__name__)


def _lock(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Lock:
    locks: dict[tuple[str, str], asyncio.Lock] = memo.pool_key_locks
    return locks.setdefault((namespace, name), asyncio.Lock())


def _remember(memo: kopf.Memo, pool: Mapping[str, Any], data: Mapping[str, Any],
              annotations: Mapping[str, str] | None) -> None:
    """Record the pool Secret's data as this replica wrote or found it complete (``follow_drift``)."""
    meta = pool["metadata"]
    memo.written_secrets[(meta["namespace"], meta["name"])] = {
        "owner": objects.owner_reference(pool), "data": {k: v for k, v in data.items() if v is not None},
        "annotations": {k: v for k, v in (annotations or {}).items() if v is not None}}


async def _patch_secret(memo: kopf.Memo, core: k8s.CoreV1Api, current: Any, patch: Mapping[str, Any],
                        pool: Mapping[str, Any]) -> None:
    """Merge ``patch`` into the Secret read as ``current``; 409 when it changed since (real clusters)."""
    body = {"data": dict(patch.get("data") or {}),
            "metadata": dict(patch.get("metadata") or {})}
    if current.metadata.resource_version:
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
    await core.patch_namespaced_secret(current.metadata.name, current.metadata.namespace, body,
                                       _content_type=MERGE_PATCH)
    _remember(memo, pool, {**(current.data or {}), **body["data"]},
              {**(current.metadata.annotations or {}), **(body["metadata"].get("annotations") or {})})


async def ensure(memo: kopf.Memo, pool: Mapping[str, Any]) -> None:
    """Create the pool Secret, or add the entries it lacks; kopf.TemporaryError for a keyless one."""
    name, namespace = objects.secret_name(pool["metadata"]["name"]), pool["metadata"]["namespace"]
    core = k8s.CoreV1Api(memo.api)
    async with _lock(memo, namespace, pool["metadata"]["name"]):
        current = await read_or_none(core.read_namespaced_secret, name, namespace)
        if current is None:
            # A rotation asked for before the Secret existed is already satisfied by its fresh key.
            requested = key_rotation.requested_rotation((pool.get("metadata") or {}).get("annotations"))
            notes = {key_rotation.ROTATED_FOR_ANNOTATION: requested} if requested is not None else None
            secret = objects.pool_key_secret(pool, secrets.token_bytes(objects.POOL_KEY_BYTES), annotations=notes)
            await create_unless_exists(core.create_namespaced_secret, namespace, secret)
            made = await read_or_none(core.read_namespaced_secret, name, namespace)  # ours, or one made meanwhile
            if made is not None:
                _remember(memo, pool, made.data or {}, made.metadata.annotations)
            return
        if not (current.data or {}).get(objects.POOL_KEY_KEY):
            raise kopf.TemporaryError(f"Secret {name!r} exists without key {objects.POOL_KEY_KEY!r}; the operator "
                                      f"never rotates a pool key silently: delete the Secret to get a new one",
                                      delay=60)
        missing = objects.missing_secret_data(current.data)
        if missing:
            await _patch_secret(memo, core, current, {"data": missing}, pool)
            log.info(f"Secret {namespace}/{name}: added {', '.join(sorted(missing))}.")
        elif (namespace, pool["metadata"]["name"]) not in memo.written_secrets:  # an edit since is drift
            _remember(memo, pool, current.data or {}, current.metadata.annotations)


def track(memo: kopf.Memo, event_type: str | None, namespace: str, name: str,
          annotations: Mapping[str, str], status: Mapping[str, Any]) -> None:
    """Remember (or forget) the pool ``namespace/name`` as one whose key rotation needs a step."""
    FOLLOWER.track(memo, event_type, namespace, name, key_rotation.needs_attention(annotations, status))


async def step(memo: kopf.Memo, namespace: str, name: str, pool: dict[str, Any]) -> None:
    """Read the pool's Secret, write the next rotation step and ``status.keyRotation``."""
    api: k8s.ApiClient = memo.api
    try:
        grace = key_rotation_grace_seconds(pool)
    except ValueError as exc:  # the pool shows it as Invalid; the rotation waits for a fix
        log.warning(f"Pool {namespace}/{name}: key rotation waits: {exc}")
        return
    shown = (pool.get("status") or {}).get("keyRotation")
    core = k8s.CoreV1Api(api)
    async with _lock(memo, namespace, name):
        secret = await read_or_none(core.read_namespaced_secret, objects.secret_name(name), namespace)
        if secret is None:
            return  # not reconciled yet (or Invalid from the start): its Secret is created with a fresh key
        now = datetime.datetime.now(datetime.timezone.utc)
        step_plan = key_rotation.plan(
            secret.data, secret.metadata.annotations,
            requested=key_rotation.requested_rotation((pool.get("metadata") or {}).get("annotations")),
            now=now, grace_seconds=grace, current_status=shown)
        if step_plan.secret_patch is not None:
            await _patch_secret(memo, core, secret, step_plan.secret_patch, pool)
            _log_step(namespace, name, step_plan)
    if step_plan.status is not None and _shown(step_plan.status) != _shown(shown):
        await patch_pool_status(api, namespace, name, {"keyRotation": dict(step_plan.status)})


# Steps every tracked pool's rotation each ``key_rotation_check_seconds``, until cancelled.
FOLLOWER = pool_api.PoolFollower("key_rotations", "key_rotation_check_seconds", step, "the key rotation step")
follow = FOLLOWER.follow


async def follow_drift(memo: kopf.Memo) -> None:
    """Every ``--drift-check-seconds``, on the leading replica, revert hand edits of the recorded
    pool Secrets; one pool's failure is logged and the others go on. Runs until cancelled."""
    while True:
        await asyncio.sleep(memo.options.drift_check_seconds)
        if not memo.leading:
            continue
        for namespace, name in list(memo.written_secrets):
            try:
                await _revert_drift(memo, namespace, name)
            except asyncio.CancelledError:
                raise
            except Exception:  # one pool's API trouble must not stop the others
                log.exception(f"Pool {namespace}/{name}: reading its Secret back failed; retrying")


async def _revert_drift(memo: kopf.Memo, namespace: str, pool_name: str) -> None:
    core = k8s.CoreV1Api(memo.api)
    name = objects.secret_name(pool_name)
    async with _lock(memo, namespace, pool_name):
        wanted = memo.written_secrets.get((namespace, pool_name))
        if wanted is None:
            return
        current = await read_or_none(core.read_namespaced_secret, name, namespace)
        if current is None:
            if not await drift.pool_alive(memo, namespace, pool_name):
                drift.forget_pool(memo, namespace, pool_name)
                return
            pool = {"metadata": {"name": pool_name, "namespace": namespace, "uid": wanted["owner"]["uid"]}}
            secret = objects.pool_key_secret(pool, b"\0" * objects.POOL_KEY_BYTES, annotations=wanted["annotations"])
            secret["data"] = dict(wanted["data"])  # the recorded values, the placeholder key replaced
            await create_unless_exists(core.create_namespaced_secret, namespace, secret)
            what = "was deleted; created again with the same values"
        else:
            changed = drift.changed_keys(current.data or {}, wanted["data"])
            if not changed:
                return
            pool = {"metadata": {"name": pool_name, "namespace": namespace, "uid": wanted["owner"]["uid"]}}
            await _patch_secret(memo, core, current, {"data": {k: wanted["data"].get(k) for k in changed}}, pool)
            what = f"was edited by hand (keys {', '.join(changed)}); reverted"
    drift.report(memo, "Secret", f"{namespace}/{name}", what, wanted["owner"], namespace, f"to the operator's: "
                 f"rotate the pool key with the pool annotation {key_rotation.ROTATE_ANNOTATION} instead")


def _shown(status: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (status or {}).items() if v is not None}


def _log_step(namespace: str, name: str, step_plan: key_rotation.RotationPlan) -> None:
    data = (step_plan.secret_patch or {}).get("data") or {}
    status = step_plan.status or {}
    if data.get(objects.PREVIOUS_KEY_KEY, "") is None:
        log.info(f"Pool {namespace}/{name}: the previous pool key expired and was removed.")
    if data.get(objects.POOL_KEY_KEY):
        log.info(f"Pool {namespace}/{name}: pool key rotated for {status.get('requested')!r}; the previous "
                 f"key is accepted until {status.get('previousKeyExpires')}.")
