"""Which operator replica reconciles: kopf peering, with the oldest replica as the leader.

Every replica serves the admission webhook; only one runs the reconciler.
kopf's peering does the pausing: each replica writes a keep-alive
(``{identity: {priority, lifetime, lastseen}}``) into the status of one
peering object (``ClusterKopfPeering`` for an operator of all namespaces,
``KopfPeering`` in each watched namespace otherwise), and a replica that
sees a live peer of higher priority pauses its watches and handlers; two
live peers of the same priority would pause each other, so priorities are
unique. ``start_priority`` ranks replicas by start time, older first: a
replica that starts during a rollout never takes over from the running
leader, and when the leader stops (its record is removed at once) or dies
(its record expires after ``--peering-lifetime-seconds``) the next oldest
resumes.

kopf pauses only its own watches and daemons, and exposes that state to no
handler; the operator's followers (model config, key rotation, ready peers:
loops over objects we do not own, where a kopf daemon would put a finalizer
on each, kopf #1074) ask ``memo.leading``, which ``follow`` keeps by reading
the same peering objects and asking what kopf asks of its own replica
(``paused_by``, kopf's ``process_peering_event``): is there a live record of
another replica with a higher priority than ours, or the same? Our own record
counts for nothing, as in kopf (a replica that was paused, SIGSTOP, or whose
keep-alive is late runs on while no higher peer is alive).
tests/operator/test_operator_ha.py runs two replicas with kopf's own peering
and holds the followers to the replica kopf lets run, across a leader change
and a paused leader. ``ensure_peering`` creates the peering objects at
startup when they are missing, once their CRD is served (the chart installs
it in the same release).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

PEERING_GROUP = "kopf.dev"
PEERING_VERSION = "v1"
CLUSTER_PEERINGS = "clusterkopfpeerings"
NAMESPACED_PEERINGS = "kopfpeerings"
# Seconds ensure_peering waits for the peering CRD before the operator gives up (and is restarted).
PEERING_CRD_WAIT_SECONDS = 120.0


def own_identity() -> str:
    """This replica's name among its peers: ``$POD_ID`` (the pod name, kopf's convention), else host and pid."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"


def start_priority(started: float | None = None, tiebreak: int | None = None) -> int:
    """kopf peering priority of a replica started at ``started`` (epoch seconds): older ranks higher.

    ``-(milliseconds * 1000 + tiebreak)``, tiebreak random in [0, 1000): two replicas
    started in the same millisecond still differ (equal priorities would pause both).
    Stays within 2**53, so it survives JSON as a float too.
    """
    started = time.time() if started is None else started
    tiebreak = random.randrange(1000) if tiebreak is None else tiebreak
    return -(int(started * 1000) * 1000 + tiebreak)


def paused_by(status: Mapping[str, Any] | None, identity: str, priority: int,
              now: datetime.datetime) -> list[str]:
    """The replicas for which kopf pauses replica ``identity`` of ``priority`` in a peering object
    with this ``status`` (kopf's ``process_peering_event``): those with a live record (its
    ``lastseen`` plus ``lifetime`` after ``now``) and a higher priority, or else those of the
    same priority (a tie pauses both). Empty: kopf lets it run. Its own record is not read."""
    higher: list[str] = []
    same: list[str] = []
    for other, record in (status or {}).items():
        if other == identity or not isinstance(record, Mapping):
            continue
        try:
            lastseen = datetime.datetime.fromisoformat(str(record["lastseen"]))
            lifetime = datetime.timedelta(seconds=int(record.get("lifetime", 60)))
            theirs = int(record.get("priority", 0))
        except (KeyError, TypeError, ValueError):
            continue
        if lastseen.tzinfo is None:
            lastseen = lastseen.replace(tzinfo=datetime.timezone.utc)
        if lastseen + lifetime <= now:
            continue
        if theirs > priority:
            higher.append(str(other))
        elif theirs == priority:
            same.append(str(other))
    return higher or same


def _scopes(namespaces: Sequence[str], clusterwide: bool) -> list[str | None]:
    return [None] if clusterwide else list(namespaces)


async def _read(api: k8s.ApiClient, name: str, namespace: str | None) -> dict[str, Any]:
    objects = k8s.CustomObjectsApi(api)
    if namespace is None:
        return await objects.get_cluster_custom_object(PEERING_GROUP, PEERING_VERSION, CLUSTER_PEERINGS, name)
    return await objects.get_namespaced_custom_object(
        PEERING_GROUP, PEERING_VERSION, namespace, NAMESPACED_PEERINGS, name)


async def _create(api: k8s.ApiClient, name: str, namespace: str | None) -> None:
    objects = k8s.CustomObjectsApi(api)
    kind = "ClusterKopfPeering" if namespace is None else "KopfPeering"
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "kv-offload-operator"}}
    if namespace is None:
        await objects.create_cluster_custom_object(PEERING_GROUP, PEERING_VERSION, CLUSTER_PEERINGS, {
            "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind, "metadata": meta})
    else:
        await objects.create_namespaced_custom_object(PEERING_GROUP, PEERING_VERSION, namespace, NAMESPACED_PEERINGS, {
            "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind,
            "metadata": {**meta, "namespace": namespace}})


async def ensure_peering(api: k8s.ApiClient, name: str, namespaces: Sequence[str], clusterwide: bool,
                         wait_seconds: float = PEERING_CRD_WAIT_SECONDS) -> None:
    """Create each peering object the operator needs unless it exists; wait for its CRD.

    kopf.PermanentError (the operator exits and is restarted) when the CRD is still not
    served after ``wait_seconds`` or the operator may not create the object.
    """
    deadline = time.monotonic() + wait_seconds
    for namespace in _scopes(namespaces, clusterwide):
        kind = "ClusterKopfPeering" if namespace is None else f"KopfPeering in namespace {namespace!r}"
        while True:
            try:
                await _create(api, name, namespace)
                log.info(f"Created the peering object {kind} {name!r}.")
                break
            except ApiException as exc:
                if exc.status == 409:
                    break
                if exc.status == 404 and time.monotonic() < deadline:
                    await asyncio.sleep(2.0)  # the CRD is not served yet (installed with the release)
                    continue
                crd = "clusterkopfpeerings.kopf.dev" if namespace is None else "kopfpeerings.kopf.dev"
                hint = (f"install the CRD {crd} (the chart's crds.kopfPeering) or run one replica with "
                        f"no --peering" if exc.status == 404 else
                        f"grant the operator create on {crd.split('.')[0]} (the chart's RBAC)")
                raise kopf.PermanentError(f"--peering {name}: cannot create the peering object {kind} {name!r} "
                                          f"(HTTP {exc.status} {exc.reason}): {hint}") from None


async def is_leading(api: k8s.ApiClient, name: str, identity: str, priority: int, namespaces: Sequence[str],
                     clusterwide: bool) -> bool:
    """True when kopf lets this replica run in every peering object it belongs to."""
    now = datetime.datetime.now(datetime.timezone.utc)
    for namespace in _scopes(namespaces, clusterwide):
        body = await _read(api, name, namespace)
        if paused_by(body.get("status"), identity, priority, now):
            return False
    return True


async def follow(memo: kopf.Memo) -> None:
    """Keep ``memo.leading`` (and the leader gauge) in step with the peering objects, until cancelled."""
    options = memo.options
    interval = max(0.5, min(5.0, options.peering_lifetime_seconds / 3))
    while True:
        try:
            leading = await is_leading(memo.api, options.peering_name, options.identity,
                                       options.peering_priority, options.namespaces, options.clusterwide)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unreadable: keep the last answer, kopf keeps its own
            log.warning(f"Reading the peering object {options.peering_name!r} failed ({exc}); retrying.")
        else:
            if leading != memo.leading:
                log.info(f"Replica {options.identity}: "
                         f"{'now runs the reconciler' if leading else 'stands by (another replica reconciles)'}.")
            memo.leading = leading
            memo.metrics.set_leading(leading)
        await asyncio.sleep(interval)
