"""Operator start and stop: every kopf setting, the webhook server, the API client, the followers.

``OperatorOptions`` carries the command-line settings (``main.py``) to the
startup handler through ``memo.options``; ``configure`` applies all of kopf's
settings in one place (peering: standalone, or one of several replicas,
``leadership``), fills the memo the other handlers use (``api``,
``metrics``, ``leading``, ``model_config_refs``, ``key_rotations``,
``pool_key_locks``), serves ``/metrics`` and starts the model-config,
key-rotation, ready-peers (given kopf's live pod and pool indexes) and
leadership followers; ``shut_down`` undoes it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass

import kopf
from prometheus_client import CollectorRegistry

from . import leadership, model_config_follower, pool_key, ready_peers
from .kube_api import api_client
from .operator_metrics import OperatorMetrics, serve_metrics
from .pool_spec import GROUP
from .tls_server import webhook_server


@dataclass(frozen=True)
class OperatorOptions:
    """Command-line settings handed to the startup handler through ``memo.options``."""

    # Sidecar image for pools that do not name one in spec.sidecar.image.
    sidecar_image: str
    # Webhook listening address ("0.0.0.0" = all interfaces).
    webhook_addr: str = "0.0.0.0"
    # Webhook HTTPS port.
    webhook_port: int = 9443
    # Host name put into the self-signed dev certificate and the logged URL; None = addr.
    webhook_host: str | None = None
    # Directory with tls.crt and tls.key (e.g. a cert-manager Secret); None = self-signed (dev).
    webhook_cert_dir: str | None = None
    # Seconds between checks of tls.crt/tls.key for a renewed pair (> 0).
    webhook_cert_check_seconds: float = 10.0
    # Seconds between re-reads of each pool's modelConfigRef ConfigMap (> 0).
    model_config_check_seconds: float = 60.0
    # Seconds between steps of a pool key rotation: start on request, end at expiry (> 0).
    key_rotation_check_seconds: float = 10.0
    # Seconds between reads of every running pool sidecar's /metrics for status.readyPeers (> 0).
    ready_peers_check_seconds: float = 15.0
    # Prometheus /metrics port (the chart's ServiceMonitor scrapes it); 0 = not served.
    metrics_port: int = 0
    # kopf peering object shared by the replicas; None = the only replica (standalone).
    peering_name: str | None = None
    # Seconds a replica's peering record lives without a keep-alive (another takes over after it).
    peering_lifetime_seconds: int = 60
    # kopf peering priority (leadership.start_priority: the oldest replica is the highest).
    peering_priority: int = 0
    # This replica's name among its peers (leadership.own_identity).
    identity: str = ""
    # Watched namespaces (exact names; empty with clusterwide).
    namespaces: tuple[str, ...] = ()
    # Watching every namespace (a ClusterKopfPeering) instead of `namespaces` (a KopfPeering in each).
    clusterwide: bool = False
    # Control port of DP rank 0 for pools without spec.sidecar.basePort (--sidecar-base-port).
    sidecar_base_port: int = 5710
    # tcp data-plane port for pools without spec.sidecar.dataPort (--sidecar-data-port).
    sidecar_data_port: int = 5810
    # Prefill rate (prompt tokens/s) for pools without spec.sidecar.prefillTokensPerSecond
    # (--sidecar-prefill-tokens-per-second); 0.0 = always fetch.
    sidecar_prefill_tokens_per_second: float = 0.0
    # Sharing policy for pools without spec.sidecar.peerCopies (--sidecar-peer-copies): "drop" or "cold".
    sidecar_peer_copies: str = "drop"


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
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    settings.admission.server, memo.self_signed_dir = webhook_server(
        addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host,
        cert_dir=options.webhook_cert_dir, check_seconds=options.webhook_cert_check_seconds, logger=logger)
    memo.metrics = OperatorMetrics(CollectorRegistry())
    memo.leading = options.peering_name is None
    memo.metrics.set_leading(memo.leading)
    if options.metrics_port:
        memo.metrics_runner = await serve_metrics(memo.metrics.registry, options.webhook_addr, options.metrics_port)
    memo.api = await api_client()
    if options.peering_name is not None:
        await leadership.ensure_peering(memo.api, options.peering_name, options.namespaces, options.clusterwide)
        memo.leadership_follower = asyncio.create_task(leadership.follow(memo), name="leadership-follower")
    memo.model_config_refs = {}
    memo.key_rotations = {}
    memo.pool_key_locks = {}
    memo.model_config_follower = asyncio.create_task(model_config_follower.follow(memo),
                                                     name="model-config-follower")
    memo.key_rotation_follower = asyncio.create_task(pool_key.follow(memo), name="key-rotation-follower")
    memo.ready_peers_follower = asyncio.create_task(ready_peers.follow(memo, pool_sidecars, pools),
                                                    name="ready-peers-follower")


async def shut_down(memo: kopf.Memo) -> None:
    """Stop the followers and the metrics server, close the API client, delete a self-signed dev pair."""
    for task_name in ("model_config_follower", "key_rotation_follower", "ready_peers_follower",
                      "leadership_follower"):
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
