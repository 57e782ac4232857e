"""ModelIdentity: what two pods compare beyond the fingerprint, and how it reads from strangers."""

from __future__ import annotations

import json

import pytest
from kv_offload_sidecar.engine.contract.model_identity import (
    DECLARED_FIELDS,
    MAX_FIELD_CHARS,
    ModelIdentity,
    declared_in_file,
    declared_mismatches,
    overrides_text,
    parse_declared,
)

BASE = ModelIdentity(weights="files:3f2a000000000000", dtype="bfloat16", kv_cache_dtype="bfloat16",
                     kv_layout="FLASH_ATTN/NHD/cuda:9.0", vllm_release="0.32", block_size="16",
                     hash_algo="sha256")


def test_equal_identities_have_one_digest_and_match():
    again = ModelIdentity.from_dict(json.loads(json.dumps(BASE.to_dict())))
    assert again == BASE and again.digest == BASE.digest and len(BASE.digest) == 16
    assert BASE.matches(again) and BASE.diff(again) == []


@pytest.mark.parametrize("field", ["weights", "revision", "code_revision", "quantization",
                                   "hf_overrides", "model_config", "dtype", "kv_cache_dtype",
                                   "kv_layout", "vllm_release", "block_size", "hash_algo"])
def test_every_field_changes_the_digest_and_is_named_in_the_diff(field):
    other = ModelIdentity(**{**BASE.to_dict(), field: "something-else"})
    assert other.digest != BASE.digest
    assert not BASE.matches(other)
    assert BASE.diff(other) == [f"{field}: {getattr(BASE, field) or '<none>'} != something-else"]


def test_identities_with_unknown_weights_never_match_even_each_other():
    unknown = ModelIdentity(**{**BASE.to_dict(), "weights": ""})
    assert not unknown.matches(unknown)
    assert not BASE.matches(None)
    assert "weights: <unknown> != <unknown>" in unknown.diff(unknown)[0]


@pytest.mark.parametrize("raw, message", [
    ([], "must be a JSON object"),
    ({"weights": 7}, "'weights' must be a string"),
    ({"weights": "x" * (MAX_FIELD_CHARS + 1)}, "longer than"),
    ({"tokenizer": "llama"}, r"unknown field\(s\) \['tokenizer'\]; valid fields"),
])
def test_malformed_identities_are_refused_with_the_field_named(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelIdentity.from_dict(raw)


def test_declared_fields_are_compared_only_where_the_config_states_them():
    assert declared_mismatches(BASE, {}) == []
    assert declared_mismatches(BASE, {"dtype": "bfloat16", "revision": ""}) == []
    assert declared_mismatches(BASE, {"revision": "abc123", "dtype": "float16"}) == [
        "revision: <none> != abc123", "dtype: bfloat16 != float16"]


def test_the_configmaps_declared_identity_is_read_and_checked(tmp_path):
    path = tmp_path / "offloading_config.json"
    path.write_text(json.dumps({"groups": [], "model_identity": {"revision": "abc", "dtype": ""}}))
    assert declared_in_file(str(path)) == {"revision": "abc"}
    path.write_text(json.dumps({"groups": []}))
    assert declared_in_file(str(path)) == {}
    with pytest.raises(ValueError, match=r"unknown key 'weights'; valid keys: " + DECLARED_FIELDS[0]):
        parse_declared({"weights": "files:1"})
    with pytest.raises(ValueError, match=r"'model_identity.revision' must be a string"):
        parse_declared({"revision": 3})


def test_overrides_are_spelled_one_way_and_long_ones_are_hashed():
    rope = {"rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert overrides_text(rope) == overrides_text(json.loads(json.dumps(rope, indent=3)))
    assert overrides_text(rope) == '{"rope_scaling":{"factor":4.0,"type":"yarn"}}'
    assert overrides_text({}) == overrides_text(None) == ""
    long = {f"key{i}": i for i in range(100)}
    text = overrides_text(long)
    assert text.startswith("sha256:") and len(text) == 7 + 16
    assert overrides_text({**long, "key0": 1}) != text
