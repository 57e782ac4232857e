"""Parsing real `vllm serve` command lines into VllmServeArgs."""

from __future__ import annotations

import pytest
from kv_offload_operator.translation.vllm_args import (
    VllmArgsError,
    VllmServeArgs,
    parse_vllm_args,
)

KTC = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"block_size":64}}'


def test_vllm_serve_with_positional_model_and_short_flags():
    args = parse_vllm_args(
        f"vllm serve meta-llama/Llama-3.1-8B-Instruct --block-size 16 -tp 2 -pp 3 -dp 4 "
        f"-dcp 2 -pcp 2 --kv-transfer-config '{KTC}'")
    assert args.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert (args.block_size, args.tensor_parallel_size, args.pipeline_parallel_size) == (16, 2, 3)
    assert args.data_parallel_size == 4
    assert args.decode_context_parallel_size == 2
    assert args.prefill_context_parallel_size == 2
    assert args.kv_transfer_config == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"block_size": 64}}


def test_equals_form_and_long_names():
    args = parse_vllm_args([
        "vllm", "serve", "--model=org/m", "--dtype=float16", "--kv-cache-dtype=fp8",
        "--tensor-parallel-size=8", "--pipeline-parallel-size=2",
        "--decode-context-parallel-size=4", "--prefill-context-parallel-size=1",
        f"--kv-transfer-config={KTC}", "--prefix-caching-hash-algo=sha256_cbor",
    ])
    assert args.model == "org/m"
    assert (args.dtype, args.kv_cache_dtype) == ("float16", "fp8")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (8, 2)
    assert args.decode_context_parallel_size == 4
    assert args.prefix_caching_hash_algo == "sha256_cbor"
    assert args.kv_transfer_config["kv_connector_extra_config"] == {"block_size": 64}


def test_python_module_entrypoint_with_model_flag():
    args = parse_vllm_args(
        "python3 -u -m vllm.entrypoints.openai.api_server --model /models/llama --port 8000 -tp 4")
    assert args.model == "/models/llama"
    assert args.tensor_parallel_size == 4


def test_cli_main_module_entrypoint():
    args = parse_vllm_args(["python", "-m", "vllm.entrypoints.cli.main", "serve", "org/m", "-tp", "2"])
    assert (args.model, args.tensor_parallel_size) == ("org/m", 2)


def test_flags_only_and_serve_without_program():
    assert parse_vllm_args("--model org/m --block-size 32").block_size == 32
    assert parse_vllm_args("serve org/m -dp 2").model == "org/m"
    assert parse_vllm_args("/usr/local/bin/vllm serve org/m").model == "org/m"


def test_unknown_flags_are_skipped_with_their_values():
    args = parse_vllm_args(
        "vllm serve --trust-remote-code org/m --max-model-len 8192 --gpu-memory-utilization 0.9 "
        "--enable-chunked-prefill --served-model-name llama --max-num-seqs=256 --seed -1 "
        "--enforce-eager -tp 2")
    assert args.model == "org/m"
    assert args.tensor_parallel_size == 2


def test_attached_compilation_level_does_not_swallow_the_model():
    assert parse_vllm_args("vllm serve -O3 org/m -tp 2").model == "org/m"


def test_unknown_flag_value_is_not_taken_as_the_model():
    args = parse_vllm_args("vllm serve --host 0.0.0.0 --port 8000 --model org/m")
    assert args.model == "org/m"


def test_positional_model_wins_over_model_flag():
    assert parse_vllm_args("vllm serve org/positional --model org/flag").model == "org/positional"


def test_underscored_flag_names_are_accepted():
    args = parse_vllm_args("vllm serve org/m --tensor_parallel_size 4 --block_size=32")
    assert (args.tensor_parallel_size, args.block_size) == (4, 32)


def test_dotted_kv_transfer_config_overrides_merge_into_the_json():
    args = parse_vllm_args(
        f"vllm serve org/m --kv-transfer-config '{KTC}' "
        "--kv-transfer-config.engine_id pool-a "
        "--kv-transfer-config.kv_connector_extra_config.blocks_per_chunk=2")
    assert args.kv_transfer_config["engine_id"] == "pool-a"
    assert args.kv_transfer_config["kv_connector_extra_config"] == {"block_size": 64, "blocks_per_chunk": 2}


def test_kv_offloading_shorthand_and_booleans():
    args = parse_vllm_args(
        "vllm serve org/m --kv-offloading-size 10 --kv-offloading-backend native "
        "--no-enable-prefix-caching --disable-hybrid-kv-cache-manager --prefix-match-unit 32 "
        "--distributed-executor-backend ray --nnodes 2 "
        "--kv-events-config '{\"enable_kv_cache_events\": true}'")
    assert args.kv_offloading_size == 10.0
    assert args.kv_offloading_backend == "native"
    assert args.enable_prefix_caching is False
    assert args.disable_hybrid_kv_cache_manager is True
    assert args.prefix_match_unit == 32
    assert args.distributed_executor_backend == "ray"
    assert args.nnodes == 2
    assert args.kv_events_config == {"enable_kv_cache_events": True}


def test_leading_environment_assignments_are_kept():
    args = parse_vllm_args("VLLM_USE_V2_MODEL_RUNNER=0 VLLM_KV_CACHE_LAYOUT=HND vllm serve org/m")
    assert args.env == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_KV_CACHE_LAYOUT": "HND"}
    assert args.model == "org/m"


def test_defaults_without_flags():
    args = parse_vllm_args("vllm serve org/m")
    assert args == VllmServeArgs(model="org/m")
    assert args.block_size is None
    assert args.kv_transfer_config is None
    assert args.pod_dp_indices() == (0,)


def test_pod_dp_indices_all_ranks_without_local_size():
    assert parse_vllm_args("vllm serve m -dp 4").pod_dp_indices() == (0, 1, 2, 3)


def test_pod_dp_indices_from_start_rank_and_local_size():
    args = parse_vllm_args(
        "vllm serve m -dp 8 --data-parallel-size-local 2 --data-parallel-start-rank 4 --headless")
    assert (args.data_parallel_size_local, args.data_parallel_start_rank) == (2, 4)
    assert args.pod_dp_indices() == (4, 5)
    assert parse_vllm_args("vllm serve m -dp 4 -dpl 2 -dpr 2").pod_dp_indices() == (2, 3)


def test_pod_dp_indices_of_an_external_load_balanced_rank():
    assert parse_vllm_args("vllm serve m -dp 4 --data-parallel-rank 3").pod_dp_indices() == (3,)


@pytest.mark.parametrize("cmd, message", [
    ("vllm serve m -tp two", "--tensor-parallel-size must be an integer, got 'two'"),
    ("vllm serve m -tp 0", "--tensor-parallel-size must be at least 1"),
    ("vllm serve m --block-size", "--block-size needs a value"),
    ("vllm serve m --kv-transfer-config '{bad'", "--kv-transfer-config is not valid JSON"),
    ("vllm serve m --kv-transfer-config '[1]'", "--kv-transfer-config must be a JSON object"),
    ("vllm serve m --kv-offloading-size lots", "--kv-offloading-size must be a number of GiB"),
    ("vllm serve m -dp 2 -dpl 2 -dpr 1", "exceeds --data-parallel-size 2"),
    ("vllm serve m -dp 2 --data-parallel-rank 2", "--data-parallel-rank 2 must be below"),
    ("vllm serve m --kv-transfer-config '{\"a\": 1}", "cannot split the vLLM command line"),
    ("python -m http.server", "is not a vLLM server"),
])
def test_bad_values_name_the_flag(cmd, message):
    with pytest.raises(VllmArgsError) as err:
        parse_vllm_args(cmd)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in str(err.value)


def test_identity_flags_revision_quantization_and_hf_overrides_are_read():
    args = parse_vllm_args(
        "vllm serve org/m --revision abc123 --code_revision=c1 -q fp8 "
        "--hf-overrides '{\"rope_scaling\": {\"factor\": 4}}' --hf-overrides.rope_scaling.rope_type yarn")
    assert (args.revision, args.code_revision, args.quantization) == ("abc123", "c1", "fp8")
    assert args.hf_overrides == {"rope_scaling": {"factor": 4, "rope_type": "yarn"}}
    assert args.model == "org/m"
    assert (parse_vllm_args("vllm serve org/m --quantization=awq").quantization,
            parse_vllm_args("vllm serve org/m").revision) == ("awq", None)
