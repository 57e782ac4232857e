"""The operator's Prometheus metrics, all defined here on a registry passed in, and their server.

Namespace ``kv_offload_operator``; counters are exposed with ``_total``;
every label takes its values from a small fixed tuple below and each allowed
series is pre-created, so alerts see zeros instead of gaps. No label carries
a pool, pod or namespace name. ``serve_metrics`` runs ``/metrics`` on
``--metrics-port`` (the port the chart's ServiceMonitor scrapes).

- ``reconciles_total{result}``: pool reconciliations (ok, invalid = the spec
  never works, waiting = something it needs is missing, error = anything else).
- ``translation_errors_total``: reconciliations the translator refused (the
  vLLM arguments with the model config give no OffloadingConfig; the pool
  shows Invalid with the translator's message).
- ``admissions_total{result,reason}``: the webhook's answers.
- ``webhook_errors_total{reason}``: admissions the webhook could not decide:
  ``api_error`` (the pool could not be read: denied as ``pool_unreadable``),
  ``api_timeout`` (the API server did not answer the admission's reads within
  ``admission.READS_TIMEOUT_SECONDS``: denied as ``pool_unreadable``, retried),
  ``internal_error`` (an unexpected exception: denied as ``operator_error``).
- ``drift_reverted_total{kind}``: hand edits of an operator-owned object
  reverted within seconds (``pools.drift``: a pool's ConfigMap or Secret edited or deleted).
- ``pools{condition}``: pools by condition, as their status shows them
  (reported by the replica that reconciles; 0 on the others).
- ``leader``: 1 on the replica that runs the reconciler, 0 on the others.
- ``pools_with_mixed_model_identities``: pools whose answering sidecars show more
  than one model identity their engines attached with (``ready_peers``; each pool's
  identities and pod counts are in its ``status.modelIdentities``, and per pod in the
  sidecars' ``kv_offload_config_info{model_identity}``). Expected during a rolling
  update to other weights; reported by the leader, 0 on the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

NAMESPACE = "kv_offload_operator"
# result label of reconciles.
RECONCILE_RESULTS = ("ok", "invalid", "waiting", "error")
# reason label of allowed admissions.
ALLOWED_REASONS = ("injected", "already_injected")
# reason label of denied admissions: why the pod was refused.
DENIED_REASONS = (
    "pool_not_found",
    "pool_invalid",
    "pool_not_translated",
    "pool_updating",
    "pool_unreadable",
    "pod_mismatch",
    "operator_error",
)
# reason label of webhook_errors.
WEBHOOK_ERROR_REASONS = ("api_error", "api_timeout", "internal_error")
# kind label of drift_reverted: the operator-owned objects whose hand edits are reverted.
DRIFT_KINDS = ("ConfigMap", "Secret")
# condition label of pools: Ready, Invalid, Waiting (Ready=False, retried), Pending (never reconciled).
POOL_CONDITIONS = ("Ready", "Invalid", "Waiting", "Pending")


def pool_condition(status: Mapping[str, Any] | None) -> str:
    """The one ``POOL_CONDITIONS`` value a pool's status shows."""
    conditions = {c.get("type"): c for c in (status or {}).get("conditions") or []}
    if (conditions.get("Invalid") or {}).get("status") == "True":
        return "Invalid"
    ready = conditions.get("Ready") or {}
    if ready.get("status") == "True":
        return "Ready"
    return "Waiting" if ready else "Pending"


class _PoolConditions(Collector):
    """``kv_offload_operator_pools{condition}`` from the pools' last seen status."""

    def __init__(self) -> None:
        self.by_pool: dict[tuple[str, str], str] = {}
        self.reporting = True

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(f"{NAMESPACE}_pools", "KVOffloadPools by the condition their status shows "
                                   "(reported by the replica that reconciles; 0 on the others).",
                                   labels=["condition"])
        counted = list(self.by_pool.values()) if self.reporting else []
        for condition in POOL_CONDITIONS:
            family.add_metric([condition], counted.count(condition))
        yield family


class OperatorMetrics:
    """Every metric of one operator process, registered on ``registry`` (one instance per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ns = NAMESPACE
        self.reconciles = Counter("reconciles", "Pool reconciliations by result.", ["result"],
                                  namespace=ns, registry=registry)
        self.translation_errors = Counter(
            "translation_errors", "Reconciliations whose vLLM arguments or model config do not translate.",
            namespace=ns, registry=registry)
        self.admissions = Counter("admissions", "Admission answers of the sidecar webhook by result and reason.",
                                  ["result", "reason"], namespace=ns, registry=registry)
        self.webhook_errors = Counter(
            "webhook_errors", "Admissions the webhook could not decide (API errors, unexpected exceptions).",
            ["reason"], namespace=ns, registry=registry)
        self.drift_reverted = Counter(
            "drift_reverted", "Hand edits of operator-owned objects reverted to the pool's translation.",
            ["kind"], namespace=ns, registry=registry)
        self.leader = Gauge("leader", "1 on the replica that runs the reconciler, 0 on the others.",
                            namespace=ns, registry=registry)
        self.pools_with_mixed_model_identities = Gauge(
            "pools_with_mixed_model_identities",
            "Pools whose sidecars show more than one attached model identity (old and new weights "
            "during a rolling update: they never share across); see status.modelIdentities.",
            namespace=ns, registry=registry)
        self._pools = _PoolConditions()
        registry.register(self._pools)
        ProcessCollector(registry=registry)
        for result in RECONCILE_RESULTS:
            self.reconciles.labels(result=result)
        for reason in ALLOWED_REASONS:
            self.admissions.labels(result="allowed", reason=reason)
        for reason in DENIED_REASONS:
            self.admissions.labels(result="denied", reason=reason)
        for reason in WEBHOOK_ERROR_REASONS:
            self.webhook_errors.labels(reason=reason)
        for kind in DRIFT_KINDS:
            self.drift_reverted.labels(kind=kind)

    def allowed(self, reason: str) -> None:
        self.admissions.labels(result="allowed", reason=_known(reason, ALLOWED_REASONS)).inc()

    def denied(self, reason: str) -> None:
        self.admissions.labels(result="denied", reason=_known(reason, DENIED_REASONS)).inc()

    def webhook_error(self, reason: str) -> None:
        self.webhook_errors.labels(reason=_known(reason, WEBHOOK_ERROR_REASONS)).inc()

    def track_pool(self, namespace: str, name: str, status: Mapping[str, Any] | None, *, deleted: bool) -> None:
        """Remember the condition a pool's status shows (forget a deleted pool)."""
        if deleted:
            self._pools.by_pool.pop((namespace, name), None)
        else:
            self._pools.by_pool[(namespace, name)] = pool_condition(status)

    def set_leading(self, leading: bool) -> None:
        """Whether this replica runs the reconciler: the leader gauge, and pools are reported
        only there (the others' view of them is not kept current)."""
        self.leader.set(1 if leading else 0)
        self._pools.reporting = leading
        if not leading:
            self.pools_with_mixed_model_identities.set(0)


def _known(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"label value {value!r} is not one of {allowed}")
    return value


async def serve_metrics(registry: CollectorRegistry, addr: str, port: int) -> web.AppRunner:
    """Serve ``registry`` at ``http://addr:port/metrics``; stop with ``await runner.cleanup()``."""
    app = web.Application()
    app.router.add_get("/metrics", make_aiohttp_handler(registry=registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, addr, port).start()
    return runner
