"""Admission of a labelled pod: the JSON patch that wires it into its pool, or a refusal.

A pod is denied, with a sentence saying what to change, when its pool does
not exist, is Invalid, has no translated config yet or is being updated, or
when the pod itself cannot join (its vLLM arguments translate to another
fingerprint, it sets another ``PYTHONHASHSEED``, its vLLM container cannot
be found). The patch itself is built by ``pod_patch``. Every refusal is a
``Denial`` naming its reason (``operator_metrics.DENIED_REASONS``) for the
admissions metric.

On the replica that reconciles, a pod the pool as last watched admits
(kopf's watch-fed index ``handlers.pool_bodies``, ``watched_pool``) needs no
read of the pool; a refusal is decided on the pool as read, and the other
replicas (whose watches are paused) always read it. The admission's API
reads (the pool there, its modelConfigRef ConfigMap, its targetRef workload)
share one budget, ``READS_TIMEOUT_SECONDS``, well below the webhook's
``timeoutSeconds``: a slow API server gets the pod a denial
(503, ``pool_unreadable``, counted as webhook error ``api_timeout``) that its
ReplicaSet retries, never a webhook call the API server gives up on and
answers by ``failurePolicy``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from . import pod_patch as patches
from ..pools.kv_transfer import injected_connector
from ..pools.model_config import model_config
from ..pools.pool_api import get_pool
from ..pools.pool_objects import invalid_message
from ..pools.pool_source import source_release, vllm_source
from ..pools.pool_spec import POOL_LABEL, SidecarSpec
from ..translation.declared_identity import declared_identity, status_text
from ..translation.translate import pool_config


# Seconds all API reads of one admission may take together: well below the webhook's timeoutSeconds
# (the chart's webhook.timeoutSeconds, 10 by default; tests/chart hold it to at least twice this).
READS_TIMEOUT_SECONDS = 4.0


class Denial(kopf.AdmissionError):
    """A refused pod: kopf answers ``message`` with ``code``; ``reason`` labels the metric,
    ``error`` (when the webhook could not decide) the webhook-errors metric."""

    def __init__(self, reason: str, message: str, *, code: int, error: str | None = None) -> None:
        super().__init__(message, code=code)
        self.reason = reason
        self.error = error


def watched_pool(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the webhook keeps of a watched pool (the ``pool_bodies`` index value): a plain copy."""
    return {key: json.loads(json.dumps(body.get(key) or {})) for key in ("apiVersion", "kind", "metadata",
                                                                         "spec", "status")}


async def answer(pod: Mapping[str, Any], pool_name: str, namespace: str, memo: kopf.Memo,
                 watched: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """``admit``, with its answer counted in ``memo.metrics`` (admissions, webhook errors)."""
    metrics = memo.metrics
    try:
        ops = await admit(pod, pool_name, namespace, memo, watched)
    except Denial as denial:
        metrics.denied(denial.reason)
        if denial.error is not None:
            metrics.webhook_error(denial.error)
        raise
    except Exception:
        metrics.denied("operator_error")
        metrics.webhook_error("internal_error")
        raise
    metrics.allowed("injected" if ops else "already_injected")
    return ops


async def admit(pod: Mapping[str, Any], pool_name: str, namespace: str, memo: kopf.Memo,
                watched: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """RFC 6902 operations wiring ``pod`` into the pool ``pool_name`` ([] when already injected);
    ``kopf.AdmissionError`` when the pod must be denied. ``watched``: the pool as this replica's
    watch last saw it (used while it leads: its watches run), else None."""
    if patches.is_injected(pod):
        return []
    where = f"KVOffloadPool {pool_name!r} in namespace {namespace!r}"
    try:
        async with asyncio.timeout(READS_TIMEOUT_SECONDS):
            if watched is not None and memo.leading:
                try:
                    return await _admit(pod, dict(watched), namespace, memo, where)
                except Denial:
                    pass  # the watch may lag the API by a moment: a refusal is decided on the pool as read
            return await _admit(pod, await _read_pool(memo, pool_name, namespace, where), namespace, memo, where)
    except TimeoutError:
        raise Denial(
            "pool_unreadable", f"The Kubernetes API server did not answer the kv-offload operator's reads of "
            f"{where} within {READS_TIMEOUT_SECONDS:g} s; the pod's creation is retried.",
            code=503, error="api_timeout") from None


async def _read_pool(memo: kopf.Memo, pool_name: str, namespace: str, where: str) -> dict[str, Any]:
    try:
        return await get_pool(memo.api, namespace, pool_name)
    except ApiException as exc:
        if exc.status == 404:
            raise Denial(
                "pool_not_found", f"KVOffloadPool {pool_name!r} does not exist in namespace {namespace!r}: create it, "
                f"or fix the pod's label {POOL_LABEL}.", code=400) from None
        raise Denial(
            "pool_unreadable", f"The kv-offload operator could not read {where} (HTTP {exc.status} {exc.reason}); "
            f"check the operator's RBAC and namespaces.", code=500, error="api_error") from None


async def _admit(pod: Mapping[str, Any], pool: dict[str, Any], namespace: str, memo: kopf.Memo,
                 where: str) -> list[dict[str, Any]]:
    problem = invalid_message(pool)
    if problem is not None:
        raise Denial(
            "pool_invalid", f"{where} is Invalid ({problem}); fix the pool's spec before creating its pods.", code=400)
    fingerprint = (pool.get("status") or {}).get("fingerprint")
    if not fingerprint:
        raise Denial(
            "pool_not_translated", f"{where} has no translated config yet; retry once the operator has set its "
            f"status.fingerprint.", code=503)
    try:
        model = await model_config(memo.api, namespace, pool["spec"])
        source = await vllm_source(memo.api, namespace, pool["spec"])  # spec.vllmArgs or spec.targetRef
        release, _ = source_release(source, pool["spec"])
        config = pool_config(list(source.argv), model, env=source.env,
                             vllm_version=release.version, accelerators=source.accelerators)
        declared = declared_identity(list(source.argv), model)
    except (ValueError, kopf.TemporaryError) as exc:
        raise Denial(
            "pool_not_translated", f"{where} cannot be read back ({exc}); retry once the operator has reconciled it.",
            code=503) from None
    if config.fingerprint != fingerprint:
        raise Denial(
            "pool_updating", f"{where} is being updated (its spec gives fingerprint {config.fingerprint}, its status "
            f"still {fingerprint}); retry in a moment.", code=503)
    # Absent on a pool this operator version has not reconciled yet: its ConfigMap declares none.
    shown = (pool.get("status") or {}).get("declaredModelIdentity")
    if shown is not None and shown != status_text(declared):
        raise Denial(
            "pool_updating", f"{where} is being updated (its spec declares model identity "
            f"{status_text(declared)}, its status still {shown}); retry in a moment.", code=503)
    try:
        problem = patches.pod_identity_problem(pod, config, model, connector=injected_connector(pool["spec"]),
                                               source=source.where, vllm_version=release.version,
                                               declared=declared)
        sidecar = SidecarSpec.with_operator_defaults(pool, memo.options)
        ops = patches.pod_patch(pod, pool, fingerprint=fingerprint, sidecar=sidecar)
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        raise Denial("pod_mismatch", f"The pod cannot join {where}: {problem}.", code=400)
    return ops
