"""Every Kubernetes API verb the operator uses: what its RBAC must grant, and no more.

The chart's Role/ClusterRole grants exactly ``OPERATOR_RBAC``, and the
operator's tests check that every request it makes stays inside it.
"""

from __future__ import annotations

from collections.abc import Mapping

from .pool_spec import GROUP, PLURAL

# (apiGroup, resource) -> verbs. Children are never deleted by the operator:
# their owner reference deletes them with the pool.
OPERATOR_RBAC: Mapping[tuple[str, str], tuple[str, ...]] = {
    (GROUP, PLURAL): ("get", "list", "watch", "patch"),
    (GROUP, f"{PLURAL}/status"): ("patch",),
    ("", "configmaps"): ("get", "create", "patch"),
    # The pool Secret: completed and rotated by merge patches, never replaced or deleted.
    ("", "secrets"): ("get", "create", "patch"),
    ("", "services"): ("get", "create", "patch"),
    ("", "pods"): ("list", "watch"),
    ("", "events"): ("create",),
}
