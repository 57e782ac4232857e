"""The real `kv-offload` console script: translate, fingerprint and diff."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_CONFIG = str(FIXTURES / "llama-3.1-8b.json")
LLAMA_CMD = ("vllm serve meta-llama/Llama-3.1-8B-Instruct --block-size 16 -tp 2 --kv-transfer-config "
             "'{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\","
             "\"kv_connector_extra_config\":{\"block_size\":64,\"cpu_bytes_to_use\":17179869184}}'")


def kv_offload_bin() -> str:
    exe = Path(sys.executable).parent / "kv-offload"
    found = str(exe) if exe.exists() else shutil.which("kv-offload")
    assert found, "the kv-offload console script is not installed (pip install -e .)"
    return found


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([kv_offload_bin(), *argv], capture_output=True, text=True, timeout=60, env=env)


def translate_to(path: Path, cmd: str = LLAMA_CMD, *extra: str) -> dict:
    proc = run("translate", "--vllm-args", cmd, "--model-config", LLAMA_CONFIG, *extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    path.write_text(proc.stdout)
    return json.loads(proc.stdout)


def test_translate_prints_the_config_with_fingerprint(tmp_path):
    d = translate_to(tmp_path / "a.json")
    assert d["cache"] == {"tokens_per_hash": 16, "blocks_per_chunk": 4}
    assert d["worker_kv_bytes_per_block"] == 1048576
    assert d["groups"][0]["tokens_per_block"] == 16
    run_config = {
        "model_name": "meta-llama/Llama-3.1-8B-Instruct", "tokens_per_hash": 16, "blocks_per_file": 4,
        "tp_size": 2, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16,
                             "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(32)]}],
        "inference_engine": "vllm", "parallel_agnostic": False,
    }
    digest = hashlib.sha256(json.dumps(run_config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert d["fingerprint"] == digest[:16]
    assert d["namespace_digest"] == digest[:12]


def test_translate_rank_and_data_parallel_index(tmp_path):
    cmd = LLAMA_CMD.replace("-tp 2", "-tp 2 -dp 2")
    rank1 = translate_to(tmp_path / "r1.json", cmd, "--rank", "1", "--data-parallel-index", "1")
    rank0 = translate_to(tmp_path / "r0.json", cmd)
    assert rank1["parallel"]["rank"] == 1
    assert rank1["parallel"]["data_parallel_index"] == 1
    assert rank1["fingerprint"] == rank0["fingerprint"]


def test_translate_env_option_reaches_the_translation(tmp_path):
    d = translate_to(tmp_path / "v1.json", LLAMA_CMD, "--env", "VLLM_USE_V2_MODEL_RUNNER=0",
                     "--vllm-version", "0.33")
    assert d["parallel"]["is_parallelism_agnostic"] is True


def test_translate_follows_the_vllm_version_and_refuses_a_v1_runner_line_on_034(tmp_path):
    default_blocks = LLAMA_CMD.replace("--block-size 16 ", "")  # 16 tokens on 0.33, 64 on 0.34
    on_033 = translate_to(tmp_path / "a.json", default_blocks, "--vllm-version", "0.33")
    on_034 = translate_to(tmp_path / "b.json", default_blocks, "--vllm-version", "0.34.0")
    assert (on_033["groups"][0]["tokens_per_block"], on_034["groups"][0]["tokens_per_block"]) == (16, 64)
    proc = run("translate", "--vllm-args", LLAMA_CMD, "--model-config", LLAMA_CONFIG,
               "--env", "VLLM_USE_V2_MODEL_RUNNER=0")  # the newest release, 0.34
    assert proc.returncode == 2 and proc.stdout == ""
    assert ("VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been "
            "removed. Unset this variable.") in proc.stderr
    proc = run("translate", "--vllm-args", LLAMA_CMD, "--model-config", LLAMA_CONFIG,
               "--vllm-version", "0.31")
    assert proc.returncode == 2 and "use one of 0.32, 0.33, 0.34" in proc.stderr


def test_fingerprint_prints_the_fingerprint_then_the_declared_model_identity(tmp_path):
    d = translate_to(tmp_path / "a.json")
    proc = run("fingerprint", str(tmp_path / "a.json"))
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first == d["fingerprint"]
    assert d["model_identity"] == {"block_size": "16"}
    assert second.startswith("model identity (command line): block_size=16 (digest ")


def test_fingerprint_of_a_config_from_before_model_identities_declares_none(tmp_path):
    d = translate_to(tmp_path / "a.json")
    del d["model_identity"]
    old = write(tmp_path, "old.json", json.dumps(d))
    proc = run("fingerprint", old)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].startswith("model identity (command line): none stated")


QWEN_CMD = "vllm serve Qwen/Qwen3-8B --kv-offloading-size 8"
ROPE = '{"rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}}'
# Issue 47: one fingerprint, four different KV bytes.
ISSUE_47 = {"abc123": "--revision abc123", "def456": "--revision def456",
            "fp8": "--quantization fp8", "rope": f"--hf-overrides '{ROPE}'"}


def test_issue_47_lines_share_a_fingerprint_but_translate_and_fingerprint_tell_them_apart(tmp_path):
    docs = {k: translate_to(tmp_path / f"{k}.json", f"{QWEN_CMD} {flag}")
            for k, flag in ISSUE_47.items()}
    assert len({d["fingerprint"] for d in docs.values()}) == 1
    assert docs["abc123"]["model_identity"] == {"revision": "abc123"}
    assert docs["fp8"]["model_identity"] == {"quantization": "fp8"}
    assert json.loads(docs["rope"]["model_identity"]["hf_overrides"])["rope_scaling"]["factor"] == 4.0
    shown = {run("fingerprint", str(tmp_path / f"{k}.json")).stdout for k in ISSUE_47}
    assert len(shown) == 4


def test_diff_names_the_differing_revision_and_exits_1(tmp_path):
    translate_to(tmp_path / "a.json", f"{QWEN_CMD} --revision abc123")
    translate_to(tmp_path / "b.json", f"{QWEN_CMD} --revision def456")
    proc = run("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == ['model_identity.revision: "abc123" != "def456"']


def test_diff_of_serving_flags_tokenizer_and_chat_template_is_the_same_identity(tmp_path):
    translate_to(tmp_path / "a.json", f"{QWEN_CMD} --revision abc123")
    translate_to(tmp_path / "b.json", f"{QWEN_CMD} --revision abc123 --max-num-seqs 64 "
                 "--served-model-name qwen --port 8001 --gpu-memory-utilization 0.8 --seed 7 "
                 "--tokenizer Qwen/Qwen3-8B --chat-template /t/chat.jinja")
    proc = run("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.startswith("same identity")


def test_diff_of_two_ranks_of_one_pool_is_empty(tmp_path):
    translate_to(tmp_path / "a.json")
    translate_to(tmp_path / "b.json", LLAMA_CMD, "--rank", "1")
    proc = run("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 0, proc.stderr
    assert "same identity" in proc.stdout


def test_diff_lists_each_differing_field_and_exits_1(tmp_path):
    translate_to(tmp_path / "a.json")
    other = LLAMA_CMD.replace("--block-size 16", "--block-size 32").replace("-tp 2", "-tp 4")
    translate_to(tmp_path / "b.json", other)
    proc = run("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert "tokens_per_hash: 16 != 32" in lines
    assert "blocks_per_file: 4 != 2" in lines
    assert "tp_size: 2 != 4" in lines
    assert "kv_cache_groups[0].tokens_per_block: 16 != 32" in lines


def write(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("both_chunk_keys", "Specify only one of 'block_size' or 'blocks_per_chunk'"),
    ("not_a_multiple", "Use 64 instead"),
    ("missing_field", "model config has no 'num_attention_heads'"),
    ("malformed_json", "is not valid JSON"),
    ("unsupported_architecture", "num_attention_heads"),
    ("missing_file", "cannot read --model-config"),
    ("no_connector", "add --kv-transfer-config"),
    ("missing_required_option", "--model-config"),
    ("bad_rank", "rank 7 must be in [0, 2)"),
])
def test_translate_bad_input_exits_2_with_one_line_and_no_stdout(tmp_path, case, message):
    llama = json.loads(Path(LLAMA_CONFIG).read_text())
    config = LLAMA_CONFIG
    cmd = LLAMA_CMD
    extra: list[str] = []
    if case == "both_chunk_keys":
        cmd = LLAMA_CMD.replace('"block_size":64', '"block_size":64,"blocks_per_chunk":4')
    elif case == "not_a_multiple":
        cmd = LLAMA_CMD.replace('"block_size":64', '"block_size":50')
    elif case == "missing_field":
        config = write(tmp_path, "c.json", json.dumps({k: v for k, v in llama.items()
                                                         if k != "num_attention_heads"}))
    elif case == "malformed_json":
        config = write(tmp_path, "c.json", '{"num_hidden_layers": 32,')
    elif case == "unsupported_architecture":
        config = str(FIXTURES / "mamba-130m.json")
    elif case == "missing_file":
        config = str(tmp_path / "nope.json")
    elif case == "no_connector":
        cmd = "vllm serve meta-llama/Llama-3.1-8B-Instruct -tp 2"
    elif case == "bad_rank":
        extra = ["--rank", "7"]
    argv = ["translate", "--vllm-args", cmd]
    if case != "missing_required_option":
        argv += ["--model-config", config]
    proc = run(*argv, *extra)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["fingerprint", "diff"])
def test_fingerprint_and_diff_reject_bad_files_with_exit_2(tmp_path, command):
    bad = write(tmp_path, "bad.json", "{not json")
    good = tmp_path / "good.json"
    translate_to(good)
    argv = [command, bad] if command == "fingerprint" else [command, str(good), bad]
    proc = run(*argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "not valid JSON" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_tampered_fingerprint_is_bad_input(tmp_path):
    d = translate_to(tmp_path / "a.json")
    d["cache"]["tokens_per_hash"] = 32
    tampered = write(tmp_path, "t.json", json.dumps(d))
    proc = run("fingerprint", tampered)
    assert proc.returncode == 2
    assert "regenerate it with 'kv-offload translate'" in proc.stderr
