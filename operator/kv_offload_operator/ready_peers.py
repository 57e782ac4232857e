"""``status.readyPeers``: the pool's sidecars whose handshakes accept each other, written on change.

A sidecar counts when its pod carries the pool label, its ``kv-offload-sidecar``
container is started (its startupProbe passed) and running, and the webhook
injected it with the pool's *current* fingerprint (annotation
``kv-offload.io/injected``). Such sidecars share the fingerprint, the pool key
and the hash seed (both from the pool Secret), so every handshake between
them is accepted; a pod injected before a spec change, or one whose sidecar is
restarting, is not counted. vLLM's own readiness (the pod's Ready condition,
minutes of model loading) does not matter here.

Read from pod status alone (kopf's index of the pool pods' running sidecars,
counted against kopf's index of the pools' fingerprints, on every pod event and
every pool event): the operator calls no pod. What it cannot see is the network between sidecars; the sidecars'
``kv_offload_peers{state}`` and ``kv_offload_handshakes_total`` metrics do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from .kube_api import patch_pool_status
from .pod_patch import INJECTED_ANNOTATION, SIDECAR_NAME


def sidecar_is_running(status: Mapping[str, Any] | None, annotations: Mapping[str, str] | None,
                       **_: Any) -> bool:
    """The pod's injected sidecar is started and running (a kopf ``when`` filter)."""
    if not (annotations or {}).get(INJECTED_ANNOTATION):
        return False
    for c in (status or {}).get("initContainerStatuses") or []:
        if c.get("name") == SIDECAR_NAME:
            return bool(c.get("started")) and "running" in (c.get("state") or {})
    return False


def count_matching(fingerprints: Iterable[str], fingerprint: str | None) -> int | None:
    """How many running sidecars were injected with ``fingerprint``; None while the pool has none."""
    if not fingerprint:
        return None
    return sum(1 for f in fingerprints if f == fingerprint)


async def write_ready_peers(memo: kopf.Memo, namespace: str, pool: str, count: int | None,
                            shown: int | None = None) -> None:
    """Patch the pool's ``status.readyPeers`` unless ``count`` is None or already written
    (``shown``: what the pool's status shows; else what this operator last wrote).

    A pod naming a pool that does not exist is ignored (the webhook denies new ones).
    """
    key = (namespace, pool)
    if count is None or (shown if shown is not None else memo.ready_counts.get(key)) == count:
        return
    try:
        await patch_pool_status(memo.api, namespace, pool, {"readyPeers": count})
    except ApiException as exc:
        if exc.status == 404:
            return
        raise
    memo.ready_counts[key] = count
