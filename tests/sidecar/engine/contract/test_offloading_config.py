"""The OffloadingConfig boundary: JSON round trip, the fingerprint vLLM's P2P tier computes, identity diff."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from kv_offload_sidecar.engine.contract.offloading_config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    canonical_format_id,
    identity_diff,
    load_config_file,
)

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))


def make_config(**overrides) -> OffloadingConfig:
    parallel = dict(rank=0, world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1,
                    data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                    is_parallelism_agnostic=False)
    parallel.update(overrides.pop("parallel", {}))
    fields = dict(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=LAYERS, group_id=0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 1 << 30, "block_size": 64,
                      "secondary_tiers": [{"type": "p2p", "port": 5710}]},
        engine_id="engine-a",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(**parallel),
    )
    fields.update(overrides)
    return OffloadingConfig(**fields)


def run_config_hash(d: dict) -> str:
    """sha256 of the run config's canonical JSON (sorted keys, no spaces), as vLLM's P2P tier
    fingerprints it, written out independently of the module under test."""
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def expected_run_config(*, tp=2, agnostic_fields=False, extra=None) -> dict:
    d = {
        "model_name": "org/model", "tokens_per_hash": 16, "blocks_per_file": 4,
        "tp_size": 1 if agnostic_fields else tp, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
        "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": list(LAYERS)}],
        "inference_engine": "vllm",
    }
    if not agnostic_fields:
        d["parallel_agnostic"] = False
    d.update(extra or {})
    return d


def test_json_round_trip_gives_an_equal_object():
    cfg = make_config(canonical_layout=True, kv_cache_layout="LBHNC", enable_kv_cache_events=True,
                      parallel={"data_parallel_size": 4, "data_parallel_index": 3,
                                "data_parallel_rank_local": 1})
    text = cfg.to_json()
    back = OffloadingConfig.from_json(text)
    assert back == cfg
    assert back.fingerprint == cfg.fingerprint
    assert json.loads(back.to_json()) == json.loads(text)


def test_json_uses_the_struct_field_names_plus_fingerprint_and_digest():
    d = json.loads(make_config().to_json())
    assert set(d) == {"groups", "worker_kv_bytes_per_block", "enable_kv_cache_events",
                      "extra_config", "engine_id", "model", "cache", "parallel",
                      "replicated_layout", "canonical_layout", "kv_cache_layout",
                      "fingerprint", "namespace_digest"}
    assert set(d["model"]) == {"name", "dtype"}
    assert set(d["cache"]) == {"tokens_per_hash", "blocks_per_chunk"}
    assert d["groups"][0] == {"tokens_per_block": 16, "layer_names": list(LAYERS), "group_id": 0}
    assert d["extra_config"]["secondary_tiers"] == [{"type": "p2p", "port": 5710}]


def test_fingerprint_of_a_tp_sharded_config_keeps_parallel_sizes():
    cfg = make_config()
    h = run_config_hash(expected_run_config(tp=2))
    assert cfg.fingerprint == h[:16]
    assert cfg.namespace_digest == h[:12]


def test_fingerprint_of_a_parallelism_agnostic_config_sets_sizes_to_one():
    cfg = make_config(parallel={"is_parallelism_agnostic": True, "tp_size": 4, "world_size": 4})
    assert cfg.fingerprint == run_config_hash(expected_run_config(agnostic_fields=True))[:16]
    # tp no longer matters once agnostic
    other = make_config(parallel={"is_parallelism_agnostic": True, "tp_size": 1, "world_size": 1})
    assert other.fingerprint == cfg.fingerprint


def test_fingerprint_of_a_replicated_layout_marks_it():
    cfg = make_config(replicated_layout=True)
    expected = expected_run_config(agnostic_fields=True, extra={"replicated_layout": True})
    assert cfg.fingerprint == run_config_hash(expected)[:16]


def test_fingerprint_of_a_canonical_layout_names_the_format_family():
    cfg = make_config(canonical_layout=True, kv_cache_layout="LBNHC")
    expected = expected_run_config(extra={"canonical_format": "v1-nhd"})
    assert cfg.fingerprint == run_config_hash(expected)[:16]
    assert canonical_format_id("LBHNC") == "v1-hnd"
    assert canonical_format_id("BLHNC") == "v1-blhnc"


def test_canonical_layout_without_a_kv_cache_layout_is_an_error():
    cfg = make_config(canonical_layout=True, kv_cache_layout=None)
    with pytest.raises(ValueError, match="kv_cache_layout"):
        _ = cfg.fingerprint


def test_rank_engine_id_and_extra_config_are_not_identity():
    a = make_config()
    b = make_config(engine_id="other", extra_config={"cpu_bytes_to_use": 5},
                    parallel={"rank": 1, "data_parallel_index": 3, "data_parallel_size": 4})
    assert a.fingerprint == b.fingerprint
    assert identity_diff(a, b) == []


def test_identity_diff_names_each_differing_field():
    a = make_config()
    b = make_config(cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=4),
                    model=OffloadingModelConfig(name="org/model", dtype="fp8"))
    assert identity_diff(a, b) == [
        'dtype: "bfloat16" != "fp8"',
        "tokens_per_hash: 16 != 32",
    ]


def test_identity_diff_reports_chunk_size_and_group_layers():
    a = make_config()
    b = make_config(
        worker_kv_bytes_per_block=8192,
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=LAYERS[:2], group_id=0),))
    lines = identity_diff(a, b)
    assert "kv_bytes_per_chunk: 32768 != 65536" in lines
    assert "kv_cache_groups[0].tokens_per_block: 16 != 32" in lines
    assert any(line.startswith("kv_cache_groups[0].layer_names: 4 layers") for line in lines)


def test_identity_diff_shows_a_key_present_on_one_side_only():
    lines = identity_diff(make_config(), make_config(parallel={"is_parallelism_agnostic": True}))
    assert "parallel_agnostic: false != <absent>" in lines
    assert "tp_size: 2 != 1" in lines


def test_derived_chunk_quantities():
    cfg = make_config()
    assert cfg.tokens_per_chunk == 64
    assert cfg.hashes_per_chunk == 4
    assert cfg.kv_bytes_per_chunk == 4096 * 4 * 2
    assert cfg.host_chunk_stride_bytes == 32768
    odd = make_config(worker_kv_bytes_per_block=1000)
    assert odd.kv_bytes_per_chunk == 8000
    assert odd.host_chunk_stride_bytes == 8192
    assert make_config(replicated_layout=True).kv_bytes_per_chunk == 4096 * 4


def test_config_is_frozen_including_extra_config():
    cfg = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine_id = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.extra_config["block_size"] = 1  # type: ignore[index]


def test_a_stated_fingerprint_that_does_not_match_is_rejected():
    d = json.loads(make_config().to_json())
    d["cache"]["tokens_per_hash"] = 32
    with pytest.raises(ValueError, match="states fingerprint"):
        OffloadingConfig.from_dict(d)


def test_a_config_without_stated_fingerprint_loads():
    d = json.loads(make_config().to_json())
    del d["fingerprint"], d["namespace_digest"]
    assert OffloadingConfig.from_dict(d) == make_config()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("groups"), "missing field 'groups'"),
    (lambda d: d.update(groups=[]), "'groups' must be a non-empty list"),
    (lambda d: d["cache"].update(blocks_per_chunk="4"), "'blocks_per_chunk' must be an integer"),
    (lambda d: d["parallel"].update(is_parallelism_agnostic="no"), "must be true or false"),
    (lambda d: d["model"].update(name=7), "'model.name' must be a string"),
    (lambda d: d.update(extra_config=[1]), "'extra_config' must be an object"),
    (lambda d: d["cache"].update(blocks_per_chunk=0), "greater than 0"),
])
def test_malformed_configs_name_the_field(mutate, message):
    d = json.loads(make_config().to_json())
    del d["fingerprint"], d["namespace_digest"]
    mutate(d)
    with pytest.raises(ValueError, match=message):
        OffloadingConfig.from_dict(d)


def test_invalid_json_is_a_value_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        OffloadingConfig.from_json("{not json")
    with pytest.raises(ValueError, match="must be a JSON object"):
        OffloadingConfig.from_json("[1, 2]")


def test_load_config_file_names_the_file(tmp_path):
    good = tmp_path / "offloading_config.json"
    good.write_text(make_config().to_json())
    assert load_config_file(str(good)) == make_config()
    with pytest.raises(ValueError, match="cannot read offloading config"):
        load_config_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=str(bad)):
        load_config_file(str(bad))
