"""The few Kubernetes API calls the operator's modules share (kubernetes_asyncio).

The API client from in-cluster or kubeconfig credentials, a read that turns
404 into None and a create that keeps an object created meanwhile; the pool's
own calls are ``pools.pool_api``. Every verb used here is in ``rbac.OPERATOR_RBAC``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"


async def api_client() -> k8s.ApiClient:
    """A client with in-cluster credentials, else $KUBECONFIG / ~/.kube/config;
    kopf.PermanentError (the operator stops) when neither works."""
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        try:
            await k8s_config.load_kube_config(client_configuration=cfg)
        except (k8s_config.ConfigException, OSError) as exc:
            raise kopf.PermanentError(f"no Kubernetes credentials: neither in-cluster nor "
                                      f"$KUBECONFIG/~/.kube/config work ({exc})") from None
    return k8s.ApiClient(cfg)


async def read_or_none(reader: Callable[[str, str], Awaitable[Any]], name: str, namespace: str) -> Any | None:
    """``reader(name, namespace)``, or None when the object does not exist."""
    try:
        return await reader(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def create_unless_exists(creator: Callable[[str, Mapping[str, Any]], Awaitable[Any]],
                               namespace: str, obj: Mapping[str, Any]) -> None:
    """``creator(namespace, obj)``; an object created meanwhile (e.g. by a restarted operator) is kept."""
    try:
        await creator(namespace, obj)
    except ApiException as exc:
        if exc.status != 409:
            raise
