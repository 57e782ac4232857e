"""The model identity a vllm serve line declares: its fields, their spelling, the ConfigMap document."""

from __future__ import annotations

import json

import pytest
from kv_offload_operator.translation.declared_identity import (
    config_document,
    config_json,
    declared_diff,
    declared_digest,
    declared_identity,
    describe,
)
from kv_offload_operator.translation.translate import TranslationError, pool_config
from kv_offload_operator.translation.vllm_args import parse_vllm_args
from kv_offload_sidecar.engine.contract.model_identity import (
    DECLARED_FIELDS,
    ModelIdentity,
    declared_in_file,
    declared_mismatches,
    overrides_text,
)
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from translation_support import LLAMA

QWEN = "vllm serve Qwen/Qwen3-8B --kv-offloading-size 8"
ROPE = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'


def test_plain_line_declares_nothing():
    assert declared_identity(QWEN, LLAMA) == {}


@pytest.mark.parametrize("flags, field, value", [
    ("--revision abc123", "revision", "abc123"),
    ("--revision=def456", "revision", "def456"),
    ("--code-revision v2", "code_revision", "v2"),
    ("--quantization fp8", "quantization", "fp8"),
    ("-q fp8", "quantization", "fp8"),
    (f"--hf-overrides '{ROPE}'", "hf_overrides",
     '{"rope_scaling":{"factor":4.0,"original_max_position_embeddings":32768,"rope_type":"yarn"}}'),
    ("--hf-overrides.rope_scaling.factor 4.0", "hf_overrides", '{"rope_scaling":{"factor":4.0}}'),
    ("--dtype half", "dtype", "float16"),
    ("--dtype float", "dtype", "float32"),
    ("--dtype bfloat16", "dtype", "bfloat16"),
    ("--kv-cache-dtype fp8_e4m3", "kv_cache_dtype", "fp8_e4m3"),
    ("--block-size 32", "block_size", "32"),
    ("--prefix-caching-hash-algo xxhash", "hash_algo", "xxhash"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_each_stated_flag_declares_its_field_as_the_engine_spells_it(flags, field, value):
    assert declared_identity(f"{QWEN} {flags}", LLAMA) == {field: value}


@pytest.mark.parametrize("flags", ["--dtype auto", "--kv-cache-dtype auto", "--hf-overrides '{}'"])
def test_auto_and_empty_values_are_left_to_the_engine(flags):
    assert declared_identity(f"{QWEN} {flags}", LLAMA) == {}


def test_the_checkpoint_quant_method_is_declared_as_vllm_normalizes_it():
    compressed = {**LLAMA, "quantization_config": {"quant_method": "compressed_tensors"}}
    assert declared_identity(QWEN, compressed) == {"quantization": "compressed-tensors"}
    fp8 = {**LLAMA, "quantization_config": {"quant_method": "FP8"}}
    assert declared_identity(QWEN, fp8) == {"quantization": "fp8"}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_checkpoint_method_vllm_renames_by_gpu_is_left_to_the_engine(method):
    quantized = {**LLAMA, "quantization_config": {"quant_method": method, "bits": 4}}
    assert declared_identity(QWEN, quantized) == {}
    assert declared_identity(f"{QWEN} -q {method}", quantized) == {}


def test_an_explicit_quantization_wins_over_the_checkpoint():
    quantized = {**LLAMA, "quantization_config": {"quant_method": "fp8"}}
    assert declared_identity(f"{QWEN} -q compressed-tensors", quantized) == {
        "quantization": "compressed-tensors"}


def test_a_dtype_the_model_refuses_names_the_flag():
    gemma = {**LLAMA, "model_type": "gemma2"}
    with pytest.raises(TranslationError, match="--dtype half"):
        declared_identity(f"{QWEN} --dtype half", gemma)


def test_malformed_hf_overrides_name_the_flag():
    with pytest.raises(TranslationError, match="--hf-overrides"):
        declared_identity(f"{QWEN} --hf-overrides '[1, 2]'", LLAMA)


ISSUE_47 = {
    "revision abc123": "--revision abc123",
    "revision def456": "--revision def456",
    "quantization fp8": "--quantization fp8",
    "RoPE yarn x4": f"--hf-overrides '{ROPE}'",
}


def test_issue_47_lines_of_one_fingerprint_declare_four_different_identities():
    configs = {k: pool_config(f"{QWEN} {v}", LLAMA) for k, v in ISSUE_47.items()}
    assert len({c.fingerprint for c in configs.values()}) == 1
    digests = {declared_digest(declared_identity(f"{QWEN} {v}", LLAMA)) for v in ISSUE_47.values()}
    assert len(digests | {declared_digest({})}) == 5


@pytest.mark.parametrize("flags", [
    "--max-num-seqs 64", "--served-model-name qwen", "--port 8001",
    "--gpu-memory-utilization 0.8", "--seed 7", "--tokenizer Qwen/Qwen3-8B-tok",
    "--chat-template /templates/chat.jinja"])
def test_serving_flags_tokenizer_and_chat_template_declare_nothing(flags):
    assert declared_identity(f"{QWEN} --revision abc123 {flags}", LLAMA) == {"revision": "abc123"}


def test_an_engine_with_the_declared_values_has_no_mismatch_and_one_without_has():
    declared = declared_identity(f"{QWEN} --revision abc123 --dtype half --block-size 16", LLAMA)
    engine = ModelIdentity(weights="hf:Qwen/Qwen3-8B@abc123", revision="abc123", dtype="float16",
                           block_size="16")
    assert declared_mismatches(engine, declared) == []
    other = ModelIdentity(weights="hf:Qwen/Qwen3-8B@def456", revision="def456", dtype="float16",
                          block_size="16")
    assert declared_mismatches(other, declared) == ['revision: def456 != abc123']


def test_declared_fields_come_in_the_contract_order():
    line = (f"{QWEN} --prefix-caching-hash-algo sha256 --block-size 16 --kv-cache-dtype fp8 "
            f"--dtype half --hf-overrides.a 1 -q fp8 --code-revision c --revision r")
    assert tuple(declared_identity(line, LLAMA)) == DECLARED_FIELDS


def test_diff_names_each_differing_declared_field_and_describe_lists_them():
    a = declared_identity(f"{QWEN} --revision abc123", LLAMA)
    b = declared_identity(f"{QWEN} --revision def456 -q fp8", LLAMA)
    assert declared_diff(a, b) == ['model_identity.revision: "abc123" != "def456"',
                                   'model_identity.quantization: <not declared> != "fp8"']
    assert declared_diff(a, a) == []
    assert describe(b) == "revision=def456 quantization=fp8"
    assert describe({}).startswith("none stated")


def test_the_config_document_round_trips_and_loads_as_the_plain_config(tmp_path):
    line = f"{QWEN} --revision abc123"
    config = pool_config(line, LLAMA)
    text = config_json(config, declared_identity(line, LLAMA))
    document = json.loads(text)
    assert document == json.loads(json.dumps(config_document(config, {"revision": "abc123"})))
    assert document == {**json.loads(config.to_json()), "model_identity": {"revision": "abc123"}}
    assert OffloadingConfig.from_json(text) == config
    path = tmp_path / "offloading_config.json"
    path.write_text(text)
    assert declared_in_file(str(path)) == {"revision": "abc123"}  # as the sidecar reads it


def test_long_hf_overrides_are_declared_as_the_engine_digests_them():
    long = json.dumps({"rope_scaling": {"factor": 4.0, "note": "x" * 300}})
    declared = declared_identity(f"{QWEN} --hf-overrides '{long}'", LLAMA)
    assert declared["hf_overrides"] == overrides_text(json.loads(long))
    assert declared["hf_overrides"].startswith("sha256:")


def test_parsed_args_are_accepted_as_they_are():
    args = parse_vllm_args(f"{QWEN} --revision abc123")
    assert declared_identity(args, LLAMA) == {"revision": "abc123"}
