"""``status.readyPeers``: how many of a pool's pods are Ready, written when the count changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from .kube_api import patch_pool_status


def pod_is_ready(status: Mapping[str, Any] | None, **_: Any) -> bool:
    """The pod's ``Ready`` condition is True (a kopf ``when`` filter)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (status or {}).get("conditions") or [])


async def write_ready_peers(memo: kopf.Memo, namespace: str, pool: str, count: int) -> None:
    """Patch the pool's ``status.readyPeers`` unless ``count`` is what was last written.

    A pod naming a pool that does not exist is ignored (the webhook denies new ones).
    """
    key = (namespace, pool)
    if memo.ready_counts.get(key) == count:
        return
    try:
        await patch_pool_status(memo.api, namespace, pool, {"readyPeers": count})
    except ApiException as exc:
        if exc.status == 404:
            return
        raise
    memo.ready_counts[key] = count
