"""The steps of a pool key rotation (key_rotation.py), without a cluster."""

from __future__ import annotations

import base64
import datetime
from typing import Any

from kv_offload_operator.pools import key_rotation as rot
from kv_offload_operator.pools import pool_objects
from pool_support import pool

T0 = datetime.datetime(2026, 3, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
NEW = b"n" * 32


def later(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def secret_data() -> dict[str, str]:
    return pool_objects.pool_key_secret(pool(), b"o" * 32)["data"]


def applied(data: dict[str, str], notes: dict[str, str],
            plan: rot.RotationPlan) -> tuple[dict[str, str], dict[str, str]]:
    """The Secret's data and annotations after the plan's merge patch."""
    patch: dict[str, Any] = dict(plan.secret_patch or {})
    out_data, out_notes = dict(data), dict(notes)
    for target, changes in ((out_data, patch.get("data") or {}),
                            (out_notes, (patch.get("metadata") or {}).get("annotations") or {})):
        for k, v in changes.items():
            if v is None:
                target.pop(k, None)
            else:
                target[k] = v
    return out_data, out_notes


def test_a_new_request_moves_the_key_to_previous_key_and_records_value_time_and_expiry() -> None:
    data = secret_data()
    plan = rot.plan(data, {}, requested="2026-03", now=T0, grace_seconds=600, new_key=NEW)
    after, notes = applied(data, {}, plan)
    assert base64.b64decode(after["key"]) == NEW
    assert after["previous-key"] == data["key"]
    assert (after["hash-seed"], after["admin-token"]) == (data["hash-seed"], data["admin-token"])
    assert notes == {rot.ROTATED_FOR_ANNOTATION: "2026-03", rot.ROTATED_AT_ANNOTATION: "2026-03-01T12:00:00Z",
                     rot.PREVIOUS_KEY_EXPIRES_ANNOTATION: "2026-03-01T12:10:00Z"}
    assert plan.status == {"requested": "2026-03", "phase": "Rotating", "since": "2026-03-01T12:00:00Z",
                           "previousKeyExpires": "2026-03-01T12:10:00Z"}


def test_the_previous_key_stays_until_its_expiry_and_then_goes() -> None:
    data, notes = applied(secret_data(), {}, rot.plan(secret_data(), {}, requested="r1", now=T0,
                                                      grace_seconds=60, new_key=NEW))
    waiting = rot.plan(data, notes, requested="r1", now=later(59), grace_seconds=60)
    assert waiting.secret_patch is None and waiting.status["phase"] == "Rotating"
    done = rot.plan(data, notes, requested="r1", now=later(60), grace_seconds=60, current_status=waiting.status)
    assert done.secret_patch == {"data": {"previous-key": None},
                                 "metadata": {"annotations": {rot.PREVIOUS_KEY_EXPIRES_ANNOTATION: None}}}
    after, after_notes = applied(data, notes, done)
    assert "previous-key" not in after and base64.b64decode(after["key"]) == NEW
    assert done.status == {"requested": "r1", "phase": "Done", "since": "2026-03-01T12:01:00Z",
                           "previousKeyExpires": None}
    # Nothing more to do: the same request again changes nothing, not even the status.
    again = rot.plan(after, after_notes, requested="r1", now=later(3600), grace_seconds=60,
                     current_status={k: v for k, v in done.status.items() if v is not None})
    assert again.secret_patch is None and again.status["since"] == "2026-03-01T12:01:00Z"


def test_a_request_during_a_rollout_waits_for_the_expiry_and_then_rotates_from_the_current_key() -> None:
    data, notes = applied(secret_data(), {}, rot.plan(secret_data(), {}, requested="r1", now=T0,
                                                      grace_seconds=60, new_key=NEW))
    early = rot.plan(data, notes, requested="r2", now=later(30), grace_seconds=60, new_key=b"x" * 32)
    assert early.secret_patch is None and early.status["requested"] == "r1"
    assert rot.needs_attention({rot.ROTATE_ANNOTATION: "r2"}, {"keyRotation": early.status})
    late = rot.plan(data, notes, requested="r2", now=later(61), grace_seconds=60, new_key=b"x" * 32)
    after, after_notes = applied(data, notes, late)
    assert base64.b64decode(after["key"]) == b"x" * 32 and base64.b64decode(after["previous-key"]) == NEW
    assert after_notes[rot.ROTATED_FOR_ANNOTATION] == "r2" and late.status["phase"] == "Rotating"


def test_without_a_request_nothing_happens_and_a_fresh_secret_made_for_one_does_not_rotate() -> None:
    data = secret_data()
    assert rot.plan(data, {}, requested=None, now=T0, grace_seconds=600) == rot.RotationPlan(None, None)
    made_for = {rot.ROTATED_FOR_ANNOTATION: "r1"}
    fresh = rot.plan(data, made_for, requested="r1", now=T0, grace_seconds=600)
    assert fresh.secret_patch is None and fresh.status["phase"] == "Done"
    assert not rot.needs_attention({rot.ROTATE_ANNOTATION: "r1"}, {"keyRotation": fresh.status})
    assert not rot.needs_attention({}, {})
    assert rot.needs_attention({rot.ROTATE_ANNOTATION: "r1"}, {})


def test_a_previous_key_without_a_readable_expiry_gets_a_full_grace_period() -> None:
    data = dict(secret_data(), **{"previous-key": secret_data()["key"]})
    plan = rot.plan(data, {rot.PREVIOUS_KEY_EXPIRES_ANNOTATION: "soon"}, requested=None, now=T0, grace_seconds=60)
    assert plan.secret_patch == {"metadata": {"annotations": {
        rot.PREVIOUS_KEY_EXPIRES_ANNOTATION: "2026-03-01T12:01:00Z"}}}
    assert plan.status["phase"] == "Rotating"


def test_timestamps_round_trip() -> None:
    assert rot.parse_timestamp(rot.timestamp(T0)) == T0
    assert rot.parse_timestamp(None) is None and rot.parse_timestamp("2026-13-01") is None
