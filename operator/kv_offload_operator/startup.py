"""Operator start and stop: every kopf setting, the webhook server, the API client, the followers.

``options.OperatorOptions`` carries the command-line settings (``cli/operator.py``) to
the startup handler through ``memo.options``; ``configure`` applies all of kopf's
settings in one place (peering: standalone, or one of several replicas,
``leadership``), fills the memo the other handlers use (``api``,
``metrics``, ``leading``, ``written_configmaps``, ``written_secrets``, ``model_config_refs``,
``key_rotations``, ``pool_key_locks``), serves ``/metrics`` and starts the model-config,
key-rotation, Secret drift (``pool_key.follow_drift``), ready-peers (given kopf's live pod and pool indexes) and
leadership followers; ``shut_down`` undoes it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

import kopf
from prometheus_client import CollectorRegistry

from . import leadership
from .kube_api import api_client
from .operator_metrics import OperatorMetrics, serve_metrics
from .options import OperatorOptions
from .pools import drift, model_config_follower, pool_key, ready_peers
from .pools.pool_spec import GROUP
from .webhook.tls_server import webhook_server


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, *,
                    pool_sidecars: kopf.Index, pools: kopf.Index) -> None:
    """All operator settings, the webhook server, the API client and the followers, in one place.

    ``pool_sidecars`` and ``pools``: kopf's live indexes (``handlers``) the ready-peers follower reads."""
    options: OperatorOptions = memo.options
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Only problems become Kubernetes Events (kubectl describe kvoffloadpool ...).
    settings.posting.level = logging.WARNING
    # Alone (no peering objects), or one of several replicas where the oldest reconciles; no CRD scanning.
    settings.peering.standalone = options.peering_name is None
    settings.peering.mandatory = options.peering_name is not None
    if options.peering_name is not None:
        settings.peering.name = options.peering_name
        settings.peering.priority = options.peering_priority
        settings.peering.lifetime = options.peering_lifetime_seconds
        settings.peering.stealth = True  # no log line per keep-alive
    settings.scanning.disabled = True
    # The drift watch sees only the ConfigMaps the operator labels, filtered by the API server.
    settings.watching.label_selectors["configmaps"] = ",".join(f"{k}={v}" for k, v in drift.MANAGED_BY.items())
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    settings.admission.server, memo.self_signed_dir = webhook_server(
        addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host,
        cert_dir=options.webhook_cert_dir, check_seconds=options.webhook_cert_check_seconds, logger=logger)
    memo.metrics = OperatorMetrics(CollectorRegistry())
    memo.leading = options.peering_name is None
    memo.metrics.set_leading(memo.leading)
    memo.metrics_runner = await serve_metrics(memo.metrics.registry, options.webhook_addr, options.metrics_port)
    memo.api = await api_client()
    if options.peering_name is not None:
        await leadership.ensure_peering(memo.api, options.peering_name, options.namespaces, options.clusterwide)
        memo.leadership_follower = asyncio.create_task(leadership.follow(memo), name="leadership-follower")
    memo.written_configmaps = {}
    memo.written_secrets = {}
    memo.model_config_refs = {}
    memo.key_rotations = {}
    memo.pool_key_locks = {}
    memo.model_config_follower = asyncio.create_task(model_config_follower.follow(memo),
                                                     name="model-config-follower")
    memo.key_rotation_follower = asyncio.create_task(pool_key.follow(memo), name="key-rotation-follower")
    memo.secret_drift_follower = asyncio.create_task(pool_key.follow_drift(memo), name="secret-drift-follower")
    memo.ready_peers_follower = asyncio.create_task(ready_peers.follow(memo, pool_sidecars, pools),
                                                    name="ready-peers-follower")


async def shut_down(memo: kopf.Memo) -> None:
    """Stop the followers and the metrics server, close the API client, delete a self-signed dev pair."""
    for task_name in ("model_config_follower", "key_rotation_follower", "secret_drift_follower",
                      "ready_peers_follower", "leadership_follower"):
        follower = getattr(memo, task_name, None)
        if follower is not None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    runner = getattr(memo, "metrics_runner", None)
    if runner is not None:
        await runner.cleanup()
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    self_signed = getattr(memo, "self_signed_dir", None)
    if self_signed is not None:
        shutil.rmtree(self_signed, ignore_errors=True)
