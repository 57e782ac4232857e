"""The pool through the API: its body read, its status patched, and the followers' round over their pools.

``get_pool`` and ``patch_pool_status`` (kubernetes_asyncio) serve the webhook's
admission and the followers that write a pool's status between reconciliations
(``model_config_follower``, ``pool_key``, ``ready_peers``). The first two follow the
pools an ``on.event`` handler remembers (``track``) and visit each of them every
interval, on the leading replica only (``each_pool_while_leading``; ``memo.leading``
is kept by ``leadership``). Every verb used here is in ``rbac.OPERATOR_RBAC``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from ..kube_api import MERGE_PATCH
from .pool_spec import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)


async def get_pool(api: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """The ``KVOffloadPool`` body; ApiException (404 when it does not exist)."""
    return await k8s.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


async def patch_pool_status(api: k8s.ApiClient, namespace: str, name: str, status: Mapping[str, Any]) -> None:
    """Merge ``status`` into the pool's status subresource."""
    await k8s.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)}, _content_type=MERGE_PATCH)


def track(tracked: dict[tuple[str, str], Any], event_type: str | None, namespace: str, name: str,
          wanted: bool) -> None:
    """Remember the pool ``namespace/name`` in ``tracked`` while a follower ``wanted`` it, forget it
    once it is not (or deleted)."""
    if wanted and event_type != "DELETED":
        tracked[(namespace, name)] = True
    else:
        tracked.pop((namespace, name), None)


async def each_pool_while_leading(memo: kopf.Memo, interval: float, tracked: dict[tuple[str, str], Any],
                                  visit: Callable[[kopf.Memo, str, str, dict[str, Any]], Awaitable[None]],
                                  what: str) -> None:
    """Every ``interval`` seconds, on the leading replica only, read each pool in ``tracked``
    and ``visit(memo, namespace, name, body)``; a pool that is gone leaves ``tracked``, one
    pool's failure is logged and the others go on. Runs until cancelled (the followers of
    model configs and key rotations)."""
    while True:
        await asyncio.sleep(interval)
        if not memo.leading:  # another replica reconciles
            continue
        for namespace, name in list(tracked):
            try:
                try:
                    pool = await get_pool(memo.api, namespace, name)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    tracked.pop((namespace, name), None)
                    continue
                await visit(memo, namespace, name, pool)
            except asyncio.CancelledError:
                raise
            except Exception:  # one pool's API trouble must not stop the others
                log.exception(f"Pool {namespace}/{name}: {what} failed; retrying")


@dataclass(frozen=True)
class PoolFollower:
    """A follower of pools: the ones an ``on.event`` handler said it wants (``track``),
    each visited every interval on the leading replica (``follow``, a startup task)."""

    # The memo attribute holding the followed pools ((namespace, name) -> True).
    tracked: str
    # The operator option holding the seconds between two rounds.
    interval: str
    # What a round does to one pool: ``visit(memo, namespace, name, body)``.
    visit: Callable[[kopf.Memo, str, str, dict[str, Any]], Awaitable[None]]
    # What a failed visit is logged as.
    what: str

    def track(self, memo: kopf.Memo, event_type: str | None, namespace: str, name: str, wanted: bool) -> None:
        track(getattr(memo, self.tracked), event_type, namespace, name, wanted)

    async def follow(self, memo: kopf.Memo) -> None:
        await each_pool_while_leading(memo, getattr(memo.options, self.interval), getattr(memo, self.tracked),
                                      self.visit, self.what)
