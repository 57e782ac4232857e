"""Operator start and stop: every kopf setting, the webhook server, the API client, the followers.

``OperatorOptions`` carries the command-line settings (``main.py``) to the
startup handler through ``memo.options``; ``configure`` applies all of kopf's
settings in one place, fills the memo the other handlers use (``api``,
``ready_counts``, ``model_config_refs``, ``key_rotations``,
``pool_key_locks``) and starts the model-config and key-rotation followers;
``shut_down`` undoes it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass

import kopf

from . import model_config_follower, pool_key
from .kube_api import api_client
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


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger) -> None:
    """All operator settings, the webhook server and the API client, in one place."""
    options: OperatorOptions = memo.options
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Only problems become Kubernetes Events (kubectl describe kvoffloadpool ...).
    settings.posting.level = logging.WARNING
    # One replica; no peering objects, no CRD scanning: least RBAC.
    settings.peering.standalone = True
    settings.peering.mandatory = False
    settings.scanning.disabled = True
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    settings.admission.server, memo.self_signed_dir = webhook_server(
        addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host,
        cert_dir=options.webhook_cert_dir, check_seconds=options.webhook_cert_check_seconds, logger=logger)
    memo.api = await api_client()
    memo.ready_counts = {}
    memo.model_config_refs = {}
    memo.key_rotations = {}
    memo.pool_key_locks = {}
    memo.model_config_follower = asyncio.create_task(model_config_follower.follow(memo),
                                                     name="model-config-follower")
    memo.key_rotation_follower = asyncio.create_task(pool_key.follow(memo), name="key-rotation-follower")


async def shut_down(memo: kopf.Memo) -> None:
    """Stop the followers, close the API client, delete a self-signed dev pair."""
    for task_name in ("model_config_follower", "key_rotation_follower"):
        follower = getattr(memo, task_name, None)
        if follower is not None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    self_signed = getattr(memo, "self_signed_dir", None)
    if self_signed is not None:
        shutil.rmtree(self_signed, ignore_errors=True)
