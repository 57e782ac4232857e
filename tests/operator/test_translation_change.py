"""Only an unchanged spec, model config and workload that translate to another fingerprint are
an upgrade's fingerprint change; a first translation or an edit is not."""

from __future__ import annotations

from typing import Any

from kv_offload_operator.pools.translation_change import TRANSLATED_BY, change_conditions, fingerprint_change

NOW = "2026-12-06T10:00:00Z"


def reconciled(generation: int = 3, **extra: Any) -> dict[str, Any]:
    """A status an earlier operator left after translating ``generation``."""
    return {"fingerprint": "00000000000000aa", "observedGeneration": generation, "translatedBy": "kv-offload 0.0.9",
            "conditions": [{"type": "Ready", "status": "True", "observedGeneration": generation}], **extra}


def test_an_unchanged_generation_translated_to_another_fingerprint_names_both_fingerprints_and_operators() -> None:
    message = fingerprint_change(reconciled(), 3, "00000000000000bb", {"modelConfigDigest": None})
    assert message is not None
    for text in ("00000000000000aa", "00000000000000bb", "kv-offload 0.0.9", TRANSLATED_BY, "generation 3"):
        assert text in message
    assert "unrecorded" in (fingerprint_change(reconciled(translatedBy=None), 3, "00000000000000bb", {}) or "")


def test_a_first_translation_a_spec_edit_an_edited_model_config_or_a_failed_generation_is_no_upgrade_change() -> None:
    assert fingerprint_change({}, 1, "00000000000000bb", {}) is None
    assert fingerprint_change(reconciled(), 3, "00000000000000aa", {}) is None
    assert fingerprint_change(reconciled(), 4, "00000000000000bb", {}) is None
    assert fingerprint_change(reconciled(modelConfigDigest="1111"), 3, "00000000000000bb",
                              {"modelConfigDigest": "2222"}) is None
    invalid = reconciled(conditions=[{"type": "Ready", "status": "False", "observedGeneration": 3}])
    assert fingerprint_change(invalid, 3, "00000000000000bb", {}) is None


def test_the_condition_stays_while_the_spec_is_unchanged_and_goes_with_the_next_spec() -> None:
    (cond,) = change_conditions(None, "changed", 3, NOW)
    assert (cond["type"], cond["status"], cond["message"]) == ("FingerprintChangedByUpgrade", "True", "changed")
    assert change_conditions([cond], None, 3, NOW) == [cond]
    assert change_conditions([cond], None, 4, NOW) == []
