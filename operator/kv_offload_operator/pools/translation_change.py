"""A pool whose unchanged spec now translates to another fingerprint: said before its pods turn over.

Each successful reconciliation records, beside ``status.fingerprint``, which
operator made it (``status.translatedBy``, ``TRANSLATED_BY``). When a new
operator (an upgrade, or a new leader of another release) translates the
same spec generation, with the same model config and workload digests, to
another fingerprint, the translation rules changed under the pool: pods
started before keep the old fingerprint and share only among themselves
until they are replaced. ``fingerprint_change`` finds that case;
``reconcile`` then posts a Warning Event ``FingerprintChangedByUpgrade``
before it writes the new ConfigMap, and the pool shows the condition
``FingerprintChangedByUpgrade=True`` naming both fingerprints and operators
until its spec changes (``change_conditions``). A first translation, a spec
edit, an edited model config or workload, or a pool whose last
reconciliation of this generation did not succeed is no such case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kv_offload_sidecar import __version__

# status.translatedBy of the pools this operator translates.
TRANSLATED_BY = f"kv-offload {__version__}"
# The condition type (and the Event reason) of a fingerprint changed by another operator's translation.
CONDITION = "FingerprintChangedByUpgrade"
# What a status written before translatedBy was recorded names as its operator.
UNRECORDED = "an earlier kv-offload operator (status.translatedBy unrecorded)"


def fingerprint_change(status: Mapping[str, Any], generation: int | None, fingerprint: str,
                       digests: Mapping[str, str | None]) -> str | None:
    """The sentence saying the pool's unchanged spec now translates to ``fingerprint``, else None.

    ``status``: the pool's status before this reconciliation; ``digests``: the
    ``modelConfigDigest`` / ``workloadDigest`` this reconciliation read (None: not read)."""
    old = status.get("fingerprint")
    if not old or old == fingerprint or generation is None or status.get("observedGeneration") != generation:
        return None
    if any(status.get(key) != value for key, value in digests.items()):
        return None  # an edited model config or workload is expected to change it
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    if ready.get("status") != "True" or ready.get("observedGeneration") != generation:
        return None  # the last reconciliation of this generation did not write a config
    before = status.get("translatedBy") or UNRECORDED
    return (f"{TRANSLATED_BY} translates this pool's unchanged spec (generation {generation}) to fingerprint "
            f"{fingerprint}; {before} wrote {old}. Pods started before keep {old} and share only among "
            f"themselves until they are replaced; new pods get {fingerprint}.")


def change_conditions(old: Sequence[Mapping[str, Any]] | None, message: str | None,
                      generation: int | None, now: str) -> list[dict[str, Any]]:
    """The ``FingerprintChangedByUpgrade`` condition to append to the pool's others: a new one
    for ``message``, else the one it shows while its spec generation is unchanged, else none."""
    if message is not None:
        return [{"type": CONDITION, "status": "True", "reason": "TranslationChanged", "message": message,
                 "lastTransitionTime": now, "observedGeneration": generation}]
    kept = [dict(c) for c in old or [] if c.get("type") == CONDITION and c.get("observedGeneration") == generation]
    return kept[:1]
