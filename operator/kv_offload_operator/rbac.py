"""Every Kubernetes API verb the operator uses: what its RBAC must grant, and no more.

The chart's Role/ClusterRole grants exactly ``operator_rbac(clusterwide)``:
``OPERATOR_RBAC`` plus the kopf peering objects of its scope (``--peering``,
``leadership.py``), and the operator's tests check that every request it
makes stays inside it.
"""

from __future__ import annotations

from collections.abc import Mapping

from .leadership import CLUSTER_PEERINGS, NAMESPACED_PEERINGS, PEERING_GROUP
from .pools.pool_spec import GROUP, PLURAL

# (apiGroup, resource) -> verbs. Children are never deleted by the operator:
# their owner reference deletes them with the pool.
OPERATOR_RBAC: Mapping[tuple[str, str], tuple[str, ...]] = {
    (GROUP, PLURAL): ("get", "list", "watch", "patch"),
    (GROUP, f"{PLURAL}/status"): ("patch",),
    # list and watch: the drift watch of the pools' own ConfigMaps (label-selected, ``pools.drift``).
    ("", "configmaps"): ("get", "list", "watch", "create", "patch"),
    # The pool Secret: completed and rotated by merge patches, never replaced or deleted.
    ("", "secrets"): ("get", "create", "patch"),
    ("", "services"): ("get", "create", "patch"),
    ("", "pods"): ("list", "watch"),
    ("", "events"): ("create",),
    # The workload a pool's spec.targetRef names, read for its vLLM command line (one get per
    # pool and follower interval; never listed or watched, never written).
    ("apps", "deployments"): ("get",),
    ("apps", "statefulsets"): ("get",),
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): ("get",),
}

# The peering object the replicas share: created when missing, read (leadership), watched and
# patched (kopf's keep-alives). A ClusterKopfPeering for an operator of every namespace, else a
# KopfPeering in each watched namespace.
PEERING_VERBS = ("get", "list", "watch", "create", "patch")


def operator_rbac(clusterwide: bool) -> Mapping[tuple[str, str], tuple[str, ...]]:
    """Everything the operator of one scope uses: ``OPERATOR_RBAC`` and its peering objects."""
    peerings = CLUSTER_PEERINGS if clusterwide else NAMESPACED_PEERINGS
    return {**OPERATOR_RBAC, (PEERING_GROUP, peerings): PEERING_VERBS}
