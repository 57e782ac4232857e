"""Pool key rotation without downtime: what to write into the pool Secret, and the pool's status.

Pure (no kopf, no I/O). A user asks for a rotation by setting the pool's
annotation ``kv-offload.io/rotate-pool-key`` to a new value (any string, e.g.
a date). When it differs from the value recorded on the Secret
(``kv-offload.io/rotated-for``), ``plan`` moves the current key to
``previous-key``, writes a new random ``key`` and records the value, the time
and the expiry of the previous key (now + ``spec.keyRotationGraceSeconds``).
The kubelet updates the mounted key files in place, pod by pod; each sidecar
re-reads them every 2 s and accepts both keys while ``previous-key`` exists,
so updated and not yet updated pods keep sharing. Once the previous key has
expired, ``plan`` removes it. The hash seed and the admin token never change.
A request made while a rotation still rolls out waits for its expiry, so no
pod is ever left holding neither of the keys its peers accept.
"""

from __future__ import annotations

import base64
import datetime
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .pool_objects import POOL_KEY_BYTES, POOL_KEY_KEY, PREVIOUS_KEY_KEY

# Pool annotation asking for a rotation: a value not yet handled starts one.
ROTATE_ANNOTATION = "kv-offload.io/rotate-pool-key"
# Secret annotation: the rotate-pool-key value the current key was made for.
ROTATED_FOR_ANNOTATION = "kv-offload.io/rotated-for"
# Secret annotation: when the current key was written by a rotation (RFC 3339, UTC).
ROTATED_AT_ANNOTATION = "kv-offload.io/rotated-at"
# Secret annotation: when previous-key is removed (RFC 3339, UTC); only while rotating.
PREVIOUS_KEY_EXPIRES_ANNOTATION = "kv-offload.io/previous-key-expires"
ROTATING, DONE = "Rotating", "Done"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def timestamp(when: datetime.datetime) -> str:
    """``when`` as the RFC 3339 UTC text of annotations and status."""
    return when.astimezone(datetime.timezone.utc).strftime(_TIME_FORMAT)


def parse_timestamp(text: str | None) -> datetime.datetime | None:
    """An annotation's time, or None when absent or unreadable."""
    try:
        return datetime.datetime.strptime(str(text), _TIME_FORMAT).replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return None


def requested_rotation(annotations: Mapping[str, str] | None) -> str | None:
    """The pool's ``kv-offload.io/rotate-pool-key`` value, None when it has none."""
    value = (annotations or {}).get(ROTATE_ANNOTATION)
    return None if value is None else str(value)


def needs_attention(annotations: Mapping[str, str] | None, status: Mapping[str, Any] | None) -> bool:
    """The pool asks for a rotation not yet handled, or one is rolling out (from its body alone)."""
    shown = (status or {}).get("keyRotation") or {}
    wanted = requested_rotation(annotations)
    return shown.get("phase") == ROTATING or (wanted is not None and wanted != shown.get("requested"))


@dataclass(frozen=True)
class RotationPlan:
    """One step of a rotation: the Secret patch to write and the status it leads to."""

    # JSON merge patch of the pool Secret (data and annotations); None: leave the Secret alone.
    secret_patch: Mapping[str, Any] | None
    # The pool's status.keyRotation afterwards; None: no rotation was ever asked for.
    status: Mapping[str, Any] | None


def plan(data: Mapping[str, str] | None, annotations: Mapping[str, str] | None, *, requested: str | None,
         now: datetime.datetime, grace_seconds: int, current_status: Mapping[str, Any] | None = None,
         new_key: bytes | None = None) -> RotationPlan:
    """The next step for a pool Secret with ``data`` (base64 values) and ``annotations``.

    ``requested`` is the pool's rotate-pool-key value, ``current_status`` its
    ``status.keyRotation`` (kept as it is when nothing changed), ``new_key``
    the next pool key (random when None).
    """
    data, annotations = data or {}, annotations or {}
    recorded = annotations.get(ROTATED_FOR_ANNOTATION)
    patch_data: dict[str, Any] = {}
    patch_notes: dict[str, Any] = {}
    if data.get(PREVIOUS_KEY_KEY):
        expires = parse_timestamp(annotations.get(PREVIOUS_KEY_EXPIRES_ANNOTATION))
        if expires is None:  # no readable expiry (edited by hand): give the previous key a full grace period
            expires = now + datetime.timedelta(seconds=grace_seconds)
            patch_notes[PREVIOUS_KEY_EXPIRES_ANNOTATION] = timestamp(expires)
        if now < expires:
            status = _rotating(recorded, annotations.get(ROTATED_AT_ANNOTATION) or timestamp(now), expires)
            return RotationPlan({"metadata": {"annotations": patch_notes}} if patch_notes else None, status)
        patch_data[PREVIOUS_KEY_KEY] = None  # expired: every pod holds the current key by now
        patch_notes[PREVIOUS_KEY_EXPIRES_ANNOTATION] = None
    if requested is not None and requested != recorded and data.get(POOL_KEY_KEY):
        key = new_key if new_key is not None else secrets.token_bytes(POOL_KEY_BYTES)
        expires = now + datetime.timedelta(seconds=grace_seconds)
        patch_data.update({POOL_KEY_KEY: base64.b64encode(key).decode("ascii"),
                           PREVIOUS_KEY_KEY: data[POOL_KEY_KEY]})
        patch_notes.update({ROTATED_FOR_ANNOTATION: requested, ROTATED_AT_ANNOTATION: timestamp(now),
                            PREVIOUS_KEY_EXPIRES_ANNOTATION: timestamp(expires)})
        return RotationPlan({"data": patch_data, "metadata": {"annotations": patch_notes}},
                            _rotating(requested, timestamp(now), expires))
    patch = {"data": patch_data, "metadata": {"annotations": patch_notes}} if patch_data else None
    if recorded is None:
        return RotationPlan(patch, None)
    shown = dict(current_status or {})
    if shown.get("phase") == DONE and shown.get("requested") == recorded and patch is None:
        return RotationPlan(None, shown)
    return RotationPlan(patch, {"requested": recorded, "phase": DONE, "since": timestamp(now),
                                "previousKeyExpires": None})


def _rotating(requested: str | None, since: str, expires: datetime.datetime) -> dict[str, Any]:
    return {"requested": requested, "phase": ROTATING, "since": since, "previousKeyExpires": timestamp(expires)}
