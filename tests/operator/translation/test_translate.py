"""Characterization of translate(): vLLM serve args + HF config.json -> OffloadingConfig.

Expected values follow released vLLM 0.33 (``translate`` and ``pool_config`` here are
the module's with ``vllm_version="0.33"``): build_offloading_config,
AttentionSpec.page_size_bytes, the hybrid grouping and resolve_kv_cache_block_sizes.
Fingerprints are recomputed here from vLLM's FileMapper run config (first 16 hex of
the sha256 of its sorted compact JSON), not from the module. What 0.34 changes is in
``test_translate_vllm034``; tests/vllm/test_release_offloading_configs.py holds the
output equal to each release's own build_offloading_config.
"""

from __future__ import annotations

import hashlib
import json

import functools

import pytest
from kv_offload_operator.translation import translate as translation
from kv_offload_operator.translation.translate import TranslationError
from translation_support import DEEPSEEK, GEMMA2, GPT_OSS, LLAMA, MAMBA, MISTRAL

translate = functools.partial(translation.translate, vllm_version="0.33")
pool_config = functools.partial(translation.pool_config, vllm_version="0.33")

LLAMA_NAME = "meta-llama/Llama-3.1-8B-Instruct"


def ktc(extra: dict | None = None, **top) -> str:
    """A --kv-transfer-config flag for OffloadingConnector."""
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 34, **(extra or {})}, **top}
    return "--kv-transfer-config '" + json.dumps(cfg) + "'"


def spec_fingerprint(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def layers(indices, module="self_attn") -> list[str]:
    return [f"model.layers.{i}.{module}.attn" for i in indices]


# ---- the issue's example ---------------------------------------------------

def test_llama_example_of_the_issue():
    cmd = f"vllm serve {LLAMA_NAME} --block-size 16 -tp 2 " + ktc({"block_size": 64})
    rank0 = translate(cmd, LLAMA, rank=0)
    rank1 = translate(cmd, LLAMA, rank=1)
    assert rank0.groups[0].tokens_per_block == 16
    assert rank0.cache.blocks_per_chunk == 4
    assert rank0.cache.tokens_per_hash == 16
    # 32 layers x 16 tokens x 4 heads (8 KV heads / TP 2) x 2 (K,V) x 128 x 2 bytes
    assert rank0.worker_kv_bytes_per_block == 32 * 16 * 4 * 2 * 128 * 2 == 1048576
    assert rank0.kv_bytes_per_chunk == 1048576 * 4 * 2
    assert (rank0.parallel.rank, rank1.parallel.rank) == (0, 1)
    assert rank0.fingerprint == rank1.fingerprint
    assert rank0.fingerprint == spec_fingerprint({
        "model_name": LLAMA_NAME, "tokens_per_hash": 16, "blocks_per_file": 4,
        "tp_size": 2, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": layers(range(32))}],
        "inference_engine": "vllm", "parallel_agnostic": False,
    })


def test_model_name_is_kept_exactly_as_given():
    cfg = translate("vllm serve /models/Llama-3.1-8B/ --kv-offloading-size 1", LLAMA)
    assert cfg.model.name == "/models/Llama-3.1-8B/"
    assert cfg.run_config()["model_name"] == "/models/Llama-3.1-8B/"


# ---- sizing ----------------------------------------------------------------

def test_single_group_sizing_sums_the_pages_of_every_layer():
    cfg = translate(f"vllm serve {LLAMA_NAME} " + ktc(), LLAMA)
    assert len(cfg.groups) == 1
    assert cfg.worker_kv_bytes_per_block == 32 * (8 * 16 * 256 * 2)
    assert cfg.cache.blocks_per_chunk == 1


def test_fp8_kv_cache_halves_the_page_and_names_the_dtype():
    cfg = translate(f"vllm serve {LLAMA_NAME} --kv-cache-dtype fp8 " + ktc(), LLAMA)
    assert cfg.model.dtype == "fp8"
    assert cfg.worker_kv_bytes_per_block == 32 * (8 * 16 * 256 * 1)


def test_float32_checkpoints_run_in_bfloat16_unless_dtype_says_otherwise():
    assert translate("vllm serve google/gemma-2-9b --kv-offloading-size 1", GEMMA2).model.dtype == "bfloat16"
    cfg = translate("vllm serve google/gemma-2-9b --dtype float32 --kv-offloading-size 1", GEMMA2)
    assert cfg.model.dtype == "float32"
    assert translate(f"vllm serve {LLAMA_NAME} --dtype half --kv-offloading-size 1", LLAMA).model.dtype == "float16"


def test_head_dim_falls_back_to_hidden_size_over_heads():
    no_head_dim = {k: v for k, v in LLAMA.items() if k != "head_dim"}
    assert (translate("vllm serve m --kv-offloading-size 1", no_head_dim).worker_kv_bytes_per_block
            == translate("vllm serve m --kv-offloading-size 1", LLAMA).worker_kv_bytes_per_block)


def test_blocks_per_chunk_from_extra_config():
    cfg = translate(f"vllm serve {LLAMA_NAME} " + ktc({"blocks_per_chunk": 8}), LLAMA)
    assert cfg.cache.blocks_per_chunk == 8
    assert cfg.tokens_per_chunk == 128
    assert cfg.hashes_per_chunk == 8


# ---- hybrid models ---------------------------------------------------------

def test_sliding_window_layers_form_their_own_group_dealt_round_robin():
    cfg = translate("vllm serve openai/gpt-oss-20b " + ktc({"block_size": 32}), GPT_OSS)
    assert [g.group_id for g in cfg.groups] == [0, 1]
    # layer 0 is sliding, so the sliding bucket comes first; 12 layers each
    assert list(cfg.groups[0].layer_names) == layers(range(0, 24, 2), "attn")
    assert list(cfg.groups[1].layer_names) == layers(range(1, 24, 2), "attn")
    assert [g.tokens_per_block for g in cfg.groups] == [16, 16]
    assert cfg.cache.blocks_per_chunk == 2
    # a block of the pool covers one group's 12 layers: 8 heads x 16 x 2 x 64 x 2 bytes each
    assert cfg.worker_kv_bytes_per_block == 12 * (8 * 16 * 2 * 64 * 2)
    assert cfg.parallel.is_parallelism_agnostic is False


def test_hybrid_fingerprint_lists_both_groups():
    cfg = translate("vllm serve openai/gpt-oss-20b -tp 2 " + ktc(), GPT_OSS)
    assert cfg.fingerprint == spec_fingerprint({
        "model_name": "openai/gpt-oss-20b", "tokens_per_hash": 16, "blocks_per_file": 1,
        "tp_size": 2, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [
            {"tokens_per_block": 16, "layer_names": layers(range(0, 24, 2), "attn")},
            {"tokens_per_block": 16, "layer_names": layers(range(1, 24, 2), "attn")},
        ],
        "inference_engine": "vllm", "parallel_agnostic": False,
    })


def test_gemma2_without_layer_types_alternates_sliding_and_global_layers():
    cfg = translate("vllm serve google/gemma-2-9b --kv-offloading-size 1", GEMMA2)
    assert list(cfg.groups[0].layer_names) == layers(range(0, 42, 2))
    assert list(cfg.groups[1].layer_names) == layers(range(1, 42, 2))


def test_hybrid_prefix_match_unit_sets_tokens_per_hash():
    cfg = translate("vllm serve openai/gpt-oss-20b --prefix-match-unit 8 " + ktc(), GPT_OSS)
    assert cfg.cache.tokens_per_hash == 8
    assert cfg.hashes_per_chunk == 2


def test_disabled_hybrid_manager_puts_every_layer_in_one_group():
    cfg = translate("vllm serve openai/gpt-oss-20b --disable-hybrid-kv-cache-manager " + ktc(), GPT_OSS)
    assert len(cfg.groups) == 1
    assert list(cfg.groups[0].layer_names) == layers(range(24), "attn")
    assert cfg.worker_kv_bytes_per_block == 24 * (8 * 16 * 2 * 64 * 2)


def test_model_wide_sliding_window_is_one_group_that_is_never_agnostic():
    cfg = translate("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve mistralai/Mistral-7B-v0.1 " + ktc(), MISTRAL)
    assert len(cfg.groups) == 1
    assert len(cfg.groups[0].layer_names) == 32
    assert cfg.parallel.is_parallelism_agnostic is False


# ---- parallel dimensions ---------------------------------------------------

def test_tensor_parallel_shards_kv_heads():
    tp1 = translate(f"vllm serve {LLAMA_NAME} " + ktc(), LLAMA)
    tp4 = translate(f"vllm serve {LLAMA_NAME} -tp 4 " + ktc(), LLAMA)
    assert tp4.worker_kv_bytes_per_block * 4 == tp1.worker_kv_bytes_per_block
    assert tp4.kv_bytes_per_chunk == tp1.kv_bytes_per_chunk
    assert (tp4.parallel.tp_size, tp4.parallel.world_size) == (4, 4)


def test_kv_heads_are_replicated_when_fewer_than_tp_ranks():
    cmd = f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {LLAMA_NAME} -tp 16 " + ktc()
    cfg = translate(cmd, LLAMA, rank=15)
    assert cfg.worker_kv_bytes_per_block == 32 * (1 * 16 * 256 * 2)
    assert cfg.parallel.is_parallelism_agnostic is False


def test_v1_model_runner_makes_head_sharded_attention_parallelism_agnostic():
    cmd = f"vllm serve {LLAMA_NAME} -tp 2 " + ktc()
    assert translate(cmd, LLAMA).parallel.is_parallelism_agnostic is False  # V2 runner is vLLM's default
    agnostic = translate(cmd, LLAMA, env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert agnostic.parallel.is_parallelism_agnostic is True
    single = translate(f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {LLAMA_NAME} " + ktc(), LLAMA)
    assert agnostic.fingerprint == single.fingerprint
    assert agnostic.kv_bytes_per_chunk == single.kv_bytes_per_chunk


def test_pipeline_parallel_worker_sees_only_its_stage_layers():
    cmd = f"vllm serve {LLAMA_NAME} -tp 2 -pp 3 " + ktc()
    first = translate(cmd, LLAMA, rank=0)
    last = translate(cmd, LLAMA, rank=5)
    # get_pp_indices(32, pp=3): 11, 11, 10 (the remainder goes to all but the last stage)
    assert list(first.groups[0].layer_names) == layers(range(0, 11))
    assert list(last.groups[0].layer_names) == layers(range(22, 32))
    assert first.parallel.world_size == 6
    assert last.worker_kv_bytes_per_block == 10 * (4 * 16 * 256 * 2)
    assert first.run_config()["pp_size"] == 3


def test_pipeline_layer_partition_env_is_honoured():
    cmd = f"VLLM_PP_LAYER_PARTITION=20,12 vllm serve {LLAMA_NAME} -pp 2 " + ktc()
    assert len(translate(cmd, LLAMA, rank=1).groups[0].layer_names) == 12


def test_data_parallel_engine_ids_and_indices():
    cmd = f"vllm serve {LLAMA_NAME} -dp 4 -dpl 2 -dpr 2 " + ktc(engine_id="pool")
    default = translate(cmd, LLAMA)
    assert default.parallel.data_parallel_index == 2
    assert default.parallel.data_parallel_rank_local == 0
    assert default.engine_id == "pool_dp2"
    third = translate(cmd, LLAMA, data_parallel_index=3)
    assert (third.parallel.data_parallel_index, third.parallel.data_parallel_rank_local) == (3, 1)
    assert third.parallel.data_parallel_size == 4
    assert third.engine_id == "pool_dp3"
    assert third.fingerprint == default.fingerprint


@pytest.mark.parametrize("dp_flags", ["-dp 4", "-dp 4 -dpl 2 -dpr 2", "-dp 4 --data-parallel-rank 3"])
def test_the_pool_config_carries_no_engines_dp_index_or_engine_id_suffix(dp_flags):
    cmd = f"vllm serve {LLAMA_NAME} {dp_flags} " + ktc(engine_id="pool")
    pool = pool_config(cmd, LLAMA)
    assert pool.engine_id == "pool"
    assert pool.parallel.data_parallel_index == 0
    assert pool.parallel.data_parallel_rank_local is None
    assert pool.parallel.rank == 0 and pool.parallel.data_parallel_size == 4
    for index in range(4):
        assert translate(cmd, LLAMA, data_parallel_index=index).fingerprint == pool.fingerprint


def test_without_data_parallel_the_pool_config_is_the_engines_config():
    cmd = f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {LLAMA_NAME} -tp 2 " + ktc(engine_id="pool")
    assert pool_config(cmd, LLAMA) == translate(cmd, LLAMA)
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert pool_config(cmd, LLAMA, env=env) == translate(cmd, LLAMA, env=env)
    assert pool_config(cmd, LLAMA, env=env).parallel.is_parallelism_agnostic


def test_without_data_parallel_engine_id_is_unsuffixed():
    cfg = translate(f"vllm serve {LLAMA_NAME} " + ktc(engine_id="pool"), LLAMA)
    assert cfg.engine_id == "pool"
    assert cfg.parallel.data_parallel_rank_local is None
    generated = translate(f"vllm serve {LLAMA_NAME} " + ktc(), LLAMA)
    assert generated.engine_id == translate(f"vllm serve {LLAMA_NAME} " + ktc(), LLAMA).engine_id


def test_decode_context_parallel_scales_tokens_per_block_and_hash():
    cmd = f"vllm serve {LLAMA_NAME} -tp 4 -dcp 2 --block-size 16 " + ktc({"block_size": 64})
    cfg = translate(cmd, LLAMA)
    assert cfg.groups[0].tokens_per_block == 32
    assert cfg.cache.tokens_per_hash == 32
    assert cfg.cache.blocks_per_chunk == 2
    assert cfg.parallel.world_size == 4
    assert cfg.worker_kv_bytes_per_block == 32 * (2 * 16 * 256 * 2)
    assert cfg.run_config()["dcp_size"] == 2


def test_decode_context_parallel_must_divide_tensor_parallel():
    with pytest.raises(TranslationError, match="--tensor-parallel-size 2 must be divisible by "
                                               "--decode-context-parallel-size 4"):
        translate(f"vllm serve {LLAMA_NAME} -tp 2 -dcp 4 " + ktc(), LLAMA)


def test_prefill_context_parallel_widens_the_world_but_not_the_block():
    cfg = translate(f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {LLAMA_NAME} -tp 2 -pcp 2 " + ktc(), LLAMA,
                    rank=3)
    assert cfg.parallel.world_size == 4
    assert cfg.groups[0].tokens_per_block == 16
    assert cfg.parallel.is_parallelism_agnostic is False
    assert cfg.run_config()["pcp_size"] == 2


# ---- MLA and layouts ------------------------------------------------------

def test_mla_geometry_is_one_latent_per_token():
    cfg = translate("vllm serve deepseek-ai/DeepSeek-V2-Lite --block-size 64 " + ktc(), DEEPSEEK)
    assert cfg.worker_kv_bytes_per_block == 27 * 64 * (512 + 64) * 2
    assert cfg.parallel.is_parallelism_agnostic is False
    assert cfg.replicated_layout is False  # TP 1: nothing to deduplicate


def test_pure_mla_with_tp_only_uses_the_replicated_layout():
    cmd = "vllm serve deepseek-ai/DeepSeek-V2-Lite --block-size 64 -tp 4 " + ktc()
    cfg = translate(cmd, DEEPSEEK, rank=2)
    assert cfg.replicated_layout is True
    assert cfg.kv_bytes_per_chunk == cfg.worker_kv_bytes_per_block  # one copy, not four
    assert cfg.fingerprint == spec_fingerprint({
        "model_name": "deepseek-ai/DeepSeek-V2-Lite", "tokens_per_hash": 64, "blocks_per_file": 1,
        "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 64, "layer_names": layers(range(27))}],
        "inference_engine": "vllm", "replicated_layout": True,
    })
    assert cfg.fingerprint == translate(cmd.replace("-tp 4", "-tp 2"), DEEPSEEK).fingerprint


@pytest.mark.parametrize("flags", [
    "-tp 4 -pp 2", "-tp 4 -dcp 2", "-tp 4 --distributed-executor-backend ray",
    "-tp 4 -pcp 2",
])
def test_replicated_layout_needs_single_node_mp_tp_only(flags):
    cfg = translate(f"vllm serve deepseek-ai/DeepSeek-V2-Lite --block-size 64 {flags} " + ktc(), DEEPSEEK)
    assert cfg.replicated_layout is False
    assert "parallel_agnostic" in cfg.run_config()


def test_canonical_layout_certifies_head_sharded_attention():
    cmd = f"vllm serve {LLAMA_NAME} -tp 2 " + ktc({"canonical_layout": True})
    cfg = translate(cmd, LLAMA)
    assert cfg.canonical_layout is True
    assert cfg.kv_cache_layout == "LBHNC"
    assert cfg.parallel.is_parallelism_agnostic is True
    assert cfg.replicated_layout is False
    assert cfg.fingerprint == spec_fingerprint({
        "model_name": LLAMA_NAME, "tokens_per_hash": 16, "blocks_per_file": 1,
        "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": layers(range(32))}],
        "inference_engine": "vllm", "canonical_format": "v1-hnd",
    })
    nhd = translate("VLLM_KV_CACHE_LAYOUT=NHD " + cmd, LLAMA)
    assert nhd.kv_cache_layout == "LBNHC"
    assert nhd.run_config()["canonical_format"] == "v1-nhd"


def test_canonical_layout_is_not_certified_across_pipeline_stages():
    cfg = translate(f"vllm serve {LLAMA_NAME} -pp 2 " + ktc({"canonical_layout": True}), LLAMA)
    assert cfg.parallel.is_parallelism_agnostic is False
    assert cfg.run_config()["canonical_format"] == "v1-hnd"


def test_canonical_layout_of_pure_mla_is_replicated_even_on_one_gpu():
    cfg = translate("vllm serve deepseek-ai/DeepSeek-V2-Lite --block-size 64 "
                    + ktc({"canonical_layout": True}), DEEPSEEK)
    assert cfg.parallel.is_parallelism_agnostic is True
    assert cfg.replicated_layout is True


# ---- connector configuration -------------------------------------------------

def test_kv_offloading_size_shorthand_sets_the_connector():
    cfg = translate(f"vllm serve {LLAMA_NAME} --kv-offloading-size 10", LLAMA)
    assert cfg.extra_config["cpu_bytes_to_use"] == 10 * (1 << 30)
    half = translate(f"vllm serve {LLAMA_NAME} --kv-offloading-size 0.5", LLAMA)
    assert half.extra_config["cpu_bytes_to_use"] == 1 << 29


def test_kv_offloading_size_keeps_the_extra_config_of_a_transfer_config():
    cfg = translate(f"vllm serve {LLAMA_NAME} --kv-offloading-size 2 "
                    + ktc({"block_size": 32}, engine_id="e"), LLAMA)
    assert cfg.extra_config["cpu_bytes_to_use"] == 2 << 30
    assert cfg.cache.blocks_per_chunk == 2
    assert cfg.engine_id == "e"


def test_multi_connector_uses_its_offloading_child():
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "multi",
             "kv_connector_extra_config": {"connectors": [
                 {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                 {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 1000, "blocks_per_chunk": 2}}]}}
    cfg = translate(f"vllm serve {LLAMA_NAME} --kv-transfer-config '{json.dumps(multi)}'", LLAMA)
    assert cfg.cache.blocks_per_chunk == 2
    assert cfg.engine_id == "multi"


def test_kv_events_config_enables_events():
    cfg = translate(f"vllm serve {LLAMA_NAME} --kv-offloading-size 1 "
                    "--kv-events-config '{\"enable_kv_cache_events\": true}'", LLAMA)
    assert cfg.enable_kv_cache_events is True


# ---- errors ----------------------------------------------------------------

@pytest.mark.parametrize("cmd, model, message", [
    ("vllm serve m " + ktc({"block_size": 64, "blocks_per_chunk": 4}), LLAMA,
     "Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config."),
    ("vllm serve m --block-size 16 " + ktc({"block_size": 60}), LLAMA,
     "'block_size'=60 in kv_connector_extra_config must be a multiple of the GPU KV cache block "
     "size (16 tokens). Use 64 instead, or set 'blocks_per_chunk' to express the chunk size in blocks."),
    ("vllm serve m -tp 4 -dcp 2 " + ktc({"block_size": 48}), LLAMA, "(32 tokens). Use 64 instead"),
    ("vllm serve m " + ktc({"blocks_per_chunk": 0}), LLAMA, "'blocks_per_chunk' must be greater than 0."),
    ("vllm serve m " + ktc({"blocks_per_chunk": "two"}), LLAMA,
     "'blocks_per_chunk' in kv_connector_extra_config must be an integer, got 'two'"),
    ("vllm serve m -tp 2", LLAMA, "add --kv-transfer-config"),
    ("vllm serve m --kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'",
     LLAMA, "kv_connector is 'NixlConnector', not OffloadingConnector"),
    ("vllm serve m --kv-transfer-config '{\"kv_connector\":\"OffloadingConnector\"}'", LLAMA,
     "kv_role is None: set it to one of kv_producer, kv_consumer, kv_both"),
    ("vllm serve m --kv-offloading-size 1 --kv-offloading-backend lmcache", LLAMA,
     "--kv-offloading-backend lmcache does not use vLLM's OffloadingConnector"),
    ("vllm serve --kv-offloading-size 1", LLAMA, "name no model"),
    ("vllm serve m --kv-offloading-size 1", {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"},
     "model config has no 'num_hidden_layers'"),
    ("vllm serve m --kv-offloading-size 1",
     {k: v for k, v in LLAMA.items() if k not in ("head_dim", "hidden_size")},
     "model config has no 'hidden_size'"),
    ("vllm serve m --kv-offloading-size 1", MAMBA, "num_attention_heads"),
    ("vllm serve m --kv-offloading-size 1", {**LLAMA, "layer_types": ["mamba"] * 32},
     "layer_types[0] is 'mamba'"),
    ("vllm serve m --kv-offloading-size 1", {**LLAMA, "num_key_value_heads": "8"},
     "'num_key_value_heads' must be a positive integer"),
    ("vllm serve m --kv-offloading-size 1 --kv-cache-dtype int8_per_token_head", LLAMA,
     "--kv-cache-dtype 'int8_per_token_head' is not supported"),
    ("vllm serve m --kv-offloading-size 1 --dtype half", GEMMA2,
     "the model type 'gemma2' does not support float16"),
    ("vllm serve m --kv-offloading-size 1", DEEPSEEK, "pass --block-size explicitly"),
    ("vllm serve m --kv-offloading-size 1 --prefix-match-unit 8", LLAMA,
     "Invalid prefix_match_unit=8; with a single KV cache group"),
    ("vllm serve m --kv-offloading-size 1 -tp two", LLAMA, "--tensor-parallel-size must be an integer"),
    ("vllm serve m --kv-offloading-size 1 -tp 3", LLAMA,
     "Total number of attention heads (32) must be divisible by tensor parallel size (3)"),
    ("VLLM_KV_CACHE_LAYOUT=XYZ vllm serve m --kv-offloading-size 1", LLAMA,
     "VLLM_KV_CACHE_LAYOUT=XYZ is not a KV cache layout"),
])
def test_bad_input_is_a_one_line_translation_error(cmd, model, message):
    with pytest.raises(TranslationError) as err:
        translate(cmd, model)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_rank_and_data_parallel_index_must_be_in_range():
    cmd = f"vllm serve {LLAMA_NAME} -tp 2 -dp 2 --kv-offloading-size 1"
    with pytest.raises(TranslationError, match=r"rank 2 must be in \[0, 2\)"):
        translate(cmd, LLAMA, rank=2)
    with pytest.raises(TranslationError, match=r"data parallel index 2 must be in \[0, 2\)"):
        translate(cmd, LLAMA, data_parallel_index=2)


def test_three_configs_have_three_fingerprints():
    prints = {
        translate(f"vllm serve {LLAMA_NAME} -tp 2 " + ktc(), LLAMA).fingerprint,
        translate("vllm serve deepseek-ai/DeepSeek-V2-Lite --block-size 64 -tp 2 " + ktc(), DEEPSEEK).fingerprint,
        translate("vllm serve openai/gpt-oss-20b -tp 2 " + ktc(), GPT_OSS).fingerprint,
    }
    assert len(prints) == 3
    assert all(len(p) == 16 and int(p, 16) >= 0 for p in prints)


# ---- against released vLLM ----------------------------------------------------
# Fingerprints that vLLM 0.33.0's own build_offloading_config + FileMapper
# (parallel_agnostic=True, blocks_per_file=blocks_per_chunk, as its P2P tier
# builds them) computed for the same deployments, on KV cache specs, groups and
# KVCacheConfigs built by vLLM's kv_cache_planning from these fixtures.
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
          "hidden_size": 2560, "num_attention_heads": 8, "num_hidden_layers": 34,
          "num_key_value_heads": 4, "sliding_window": 1024, "sliding_window_pattern": 6,
          "torch_dtype": "bfloat16"}
RELEASED_VLLM = [
    (f"vllm serve {LLAMA_NAME} --block-size 16 -tp 2", LLAMA, {"block_size": 64}, 0, "e9a630addfed6bc6"),
    ("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve m -tp 2", LLAMA, {}, 0, "a01c5dda82231505"),
    ("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve m -tp 16", LLAMA, {}, 0, "b46a9776f5a222b4"),
    ("vllm serve m -tp 4 -dcp 2", LLAMA, {"block_size": 64}, 0, "fed6ff40af3653ab"),
    ("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve m -tp 2 -pp 3", LLAMA, {}, 5, "b77016986d5155b7"),
    ("vllm serve deepseek-ai/DeepSeek-V2-Lite -tp 4 --block-size 64", DEEPSEEK, {}, 0, "423ac1494159bc57"),
    ("vllm serve openai/gpt-oss-20b -tp 2", GPT_OSS, {}, 0, "1716705f462a5495"),
    ("vllm serve g -pp 2", GPT_OSS, {}, 1, "41573e687db838de"),
    ("vllm serve g", GPT_OSS, {"blocks_per_chunk": 4}, 0, "a3a32d62193aefc8"),
    ("vllm serve google/gemma-3-4b -tp 2", GEMMA3, {}, 0, "03070880c34c2a2b"),
]


@pytest.mark.parametrize("cmd, model, extra, rank, expected", RELEASED_VLLM)
def test_fingerprint_equals_what_released_vllm_computes(cmd, model, extra, rank, expected):
    assert translate(f"{cmd} " + ktc(extra, engine_id="e"), model, rank=rank).fingerprint == expected


def test_gemma3_pattern_deals_sliding_layers_over_groups_of_the_global_count():
    cfg = translate("vllm serve google/gemma-3-4b " + ktc(), GEMMA3)
    # 29 sliding + 5 global layers: groups of 5; the sliding layers are dealt over
    # 6 groups, the last one a layer short (vLLM pads it)
    assert [len(g.layer_names) for g in cfg.groups] == [5, 5, 5, 5, 5, 4, 5]
    assert cfg.groups[0].layer_names == tuple(layers([0, 7, 14, 21, 28]))
    assert cfg.groups[6].layer_names == tuple(layers(range(5, 34, 6)))
    assert cfg.worker_kv_bytes_per_block == 5 * (4 * 16 * 512 * 2)


def test_qwen2_style_disabled_sliding_window_is_full_attention():
    qwen = {**LLAMA, "sliding_window": 131072, "use_sliding_window": False}
    cfg = translate("vllm serve Qwen/Qwen2.5-7B " + ktc(), qwen)
    assert len(cfg.groups) == 1
