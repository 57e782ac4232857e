"""translate() under vLLM 0.34's rules, and how a pool's release is chosen.

What 0.34.0 changed for a translation, read in its sources (build_offloading_config,
CacheConfig, Platform.validate_environ): the V1 model runner is gone (a line setting
VLLM_USE_V2_MODEL_RUNNER to anything but 1 does not start), only canonical_layout makes a
config parallelism-agnostic, and the default block size is 64. Both releases refuse an
engine whose workers span nodes for kv-offload. tests/vllm/test_release_offloading_configs.py
runs each release's own build_offloading_config over the same deployments.
"""

from __future__ import annotations

import json

import pytest
from kv_offload_operator.translation.translate import TranslationError, pool_config, translate
from kv_offload_operator.translation.vllm_releases import (
    NEWEST,
    UnsupportedRelease,
    pool_release,
    release,
    release_of_image,
)
from translation_support import LLAMA

NAME = "meta-llama/Llama-3.1-8B-Instruct"
V1_MESSAGE = ("VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been "
              "removed. Unset this variable.")


def ktc(extra: dict | None = None) -> str:
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": "e",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 34, **(extra or {})}}
    return "--kv-transfer-config '" + json.dumps(cfg) + "'"


def test_the_newest_release_is_the_default():
    cmd = f"vllm serve {NAME} -tp 2 " + ktc()
    assert NEWEST == "0.34"
    assert translate(cmd, LLAMA) == translate(cmd, LLAMA, vllm_version="0.34")
    assert pool_config(cmd, LLAMA) == pool_config(cmd, LLAMA, vllm_version="0.34.0")


def test_a_line_without_block_size_runs_64_token_blocks_on_034_and_16_before():
    cmd = f"vllm serve {NAME} " + ktc()
    assert translate(cmd, LLAMA, vllm_version="0.34").groups[0].tokens_per_block == 64
    assert translate(cmd, LLAMA, vllm_version="0.33").groups[0].tokens_per_block == 16
    assert translate(cmd, LLAMA, vllm_version="0.32").groups[0].tokens_per_block == 16


@pytest.mark.parametrize("value", ["0", "false", ""])
def test_a_v1_runner_line_is_refused_on_034_with_vllms_own_message(value):
    cmd = f"VLLM_USE_V2_MODEL_RUNNER={value} vllm serve {NAME} -tp 2 " + ktc()
    with pytest.raises(TranslationError) as err:
        translate(cmd, LLAMA, vllm_version="0.34")
    assert V1_MESSAGE.replace("=0 ", f"={value} ") in str(err.value)
    assert str(err.value).startswith("vLLM 0.34 does not start with this line: ")
    with pytest.raises(TranslationError, match="no longer supported"):
        pool_config(f"vllm serve {NAME} " + ktc(), LLAMA,
                    env={"VLLM_USE_V2_MODEL_RUNNER": value}, vllm_version="0.34")
    assert translate(cmd, LLAMA, vllm_version="0.33")  # 0.33 still has the V1 runner


def test_v2_runner_set_explicitly_is_the_same_config_on_034():
    cmd = f"vllm serve {NAME} -tp 2 " + ktc()
    assert translate("VLLM_USE_V2_MODEL_RUNNER=1 " + cmd, LLAMA) == translate(cmd, LLAMA)


def test_only_canonical_layout_is_parallelism_agnostic_on_034():
    for flags in ("", "-tp 2", "-tp 8", "-pp 2 --distributed-executor-backend external_launcher"):
        cfg = translate(f"vllm serve {NAME} {flags} " + ktc(), LLAMA)
        assert cfg.parallel.is_parallelism_agnostic is False, flags
        assert cfg.run_config()["parallel_agnostic"] is False
    # 0.33 on its V1 runner (external_launcher with PP picks it too): agnostic without it.
    v1 = translate(f"vllm serve {NAME} -pp 2 --distributed-executor-backend external_launcher "
                   + ktc(), LLAMA, vllm_version="0.33")
    assert v1.parallel.is_parallelism_agnostic is True
    assert translate(f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {NAME} -tp 2 " + ktc(), LLAMA,
                     vllm_version="0.33").parallel.is_parallelism_agnostic is True


def test_canonical_layout_lets_tp2_and_tp4_pools_share_on_034():
    canonical = ktc({"canonical_layout": True})
    tp2 = translate(f"vllm serve {NAME} -tp 2 " + canonical, LLAMA)
    tp4 = translate(f"vllm serve {NAME} -tp 4 " + canonical, LLAMA)
    assert tp2.parallel.is_parallelism_agnostic and tp4.parallel.is_parallelism_agnostic
    assert tp2.fingerprint == tp4.fingerprint
    assert tp2.run_config()["canonical_format"] == "v1-hnd"  # the released format, 1
    assert tp2.kv_cache_layout == "LBHNC"  # the OffloadingConnector's layout, stated
    # Without canonical layout TP2 and TP4 never share; nor do canonical and direct pools.
    direct = translate(f"vllm serve {NAME} -tp 2 " + ktc(), LLAMA)
    assert len({direct.fingerprint, tp2.fingerprint,
                translate(f"vllm serve {NAME} -tp 4 " + ktc(), LLAMA).fingerprint}) == 3
    # A TP16 pool replicates KV heads (8 heads): vLLM does not certify it, nor do we.
    tp16 = translate(f"vllm serve {NAME} -tp 16 " + canonical, LLAMA)
    assert tp16.parallel.is_parallelism_agnostic is True  # 16 % 8 == 0 and 1 head per rank
    nhd = translate(f"VLLM_KV_CACHE_LAYOUT=NHD vllm serve {NAME} -tp 2 " + canonical, LLAMA)
    assert nhd.kv_cache_layout == "LBNHC" and nhd.fingerprint != tp2.fingerprint


@pytest.mark.parametrize("version", ["0.32", "0.33", "0.34"])
def test_an_engine_spanning_nodes_is_refused_saying_what_to_change(version):
    with pytest.raises(TranslationError) as err:
        translate(f"vllm serve {NAME} -tp 8 -pp 2 --nnodes 2 " + ktc(), LLAMA, vllm_version=version)
    message = str(err.value)
    assert "spans 2 nodes per engine (--nnodes 2" in message
    assert "scale out with --data-parallel-size" in message and "\n" not in message
    with pytest.raises(TranslationError, match=r"has 16 workers .* its pod has 8 accelerators"):
        translate(f"vllm serve {NAME} -tp 8 -pp 2 " + ktc(), LLAMA, vllm_version=version,
                  accelerators=8)
    # One engine per node, two nodes of DP: fine.
    assert translate(f"vllm serve {NAME} -tp 8 -dp 2 -dpl 1 --nnodes 2 " + ktc(), LLAMA,
                     vllm_version=version, accelerators=8)


def test_an_unsupported_release_is_refused_naming_the_supported_ones():
    with pytest.raises(TranslationError, match=r"vLLM 0.35 is not a release kv-offload supports: "
                                               r"use one of 0.32, 0.33, 0.34"):
        translate(f"vllm serve {NAME} " + ktc(), LLAMA, vllm_version="0.35")
    with pytest.raises(UnsupportedRelease):
        release("latest")


@pytest.mark.parametrize("image, expected", [
    ("vllm/vllm-openai:v0.34.0", "0.34"),
    ("vllm/vllm-openai:v0.33.1-cu128", "0.33"),
    ("registry.local:5000/team/vllm:0.32.0", "0.32"),
    ("vllm/vllm-openai:v0.34.0@sha256:" + "a" * 64, "0.34"),
    ("vllm/vllm-openai:v0.35.0rc1", "0.35"),
    ("vllm/vllm-openai:latest", None),
    ("vllm/vllm-openai:nightly-0123abc", None),
    ("vllm/vllm-openai@sha256:" + "a" * 64, None),
    ("registry.local:5000/vllm", None),
    (None, None),
])
def test_an_image_tag_names_a_release_or_none(image, expected):
    assert release_of_image(image) == expected


def test_a_pools_release_is_the_image_tags_else_its_field_else_the_newest():
    assert pool_release("vllm/vllm-openai:v0.33.0", "0.34")[0].version == "0.33"
    rel, where = pool_release("vllm/vllm-openai:latest", "0.32")
    assert (rel.version, where) == ("0.32", "spec.vllmVersion (0.32)")
    assert pool_release(None, None) == (release("0.34"), "the newest supported release (0.34)")
    with pytest.raises(UnsupportedRelease, match="vLLM 0.30"):
        pool_release("vllm/vllm-openai:v0.30.2", None)


def test_eagle_lookahead_hashing_on_034_is_refused_unless_disabled_on_every_pod():
    eagle = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
             "num_speculative_tokens": 3}
    cmd = f"vllm serve {NAME} -sc '{json.dumps(eagle)}' " + ktc()
    with pytest.raises(TranslationError, match=r"hashes the eagle3 drafter's lookahead tokens .* "
                                               r"add \"disable_lookahead_block_hashes\": true"):
        translate(cmd, LLAMA)
    assert translate(cmd, LLAMA, vllm_version="0.33")  # 0.33 drops the trailing block instead
    disabled = translate(cmd + " --speculative-config.disable_lookahead_block_hashes true", LLAMA)
    assert disabled.fingerprint == translate(f"vllm serve {NAME} " + ktc(), LLAMA).fingerprint
    unnamed = {"model": "some/draft", "num_speculative_tokens": 3}
    with pytest.raises(TranslationError, match=r"names a draft model but no method.*state \"method\""):
        translate(f"vllm serve {NAME} --speculative-config '{json.dumps(unnamed)}' " + ktc(), LLAMA)
