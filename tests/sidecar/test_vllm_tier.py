"""The vLLM secondary tier, driven through the calls vLLM makes, against real sidecars."""

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kv_offload_sidecar.engine_sim import SimulatedEngine, SimulatedSpec, trace_tokens
from kv_offload_sidecar.install_tier import TIER_MODULES
from kv_offload_sidecar.local_pool import LocalPool, example_config
from kv_offload_sidecar.vllm_tier import (KVOffloadSecondaryTier, LookupResult, ReqContext,
                                          TransferJob, hash_seed_problem, sidecar_address)

CONFIG = example_config()


@pytest.fixture(scope="module")
def pool():
    with LocalPool(2, config=CONFIG, summary_interval_seconds=0.05) as p:
        yield p


def _engine(pool, i, **kw):
    return SimulatedEngine(CONFIG, hash_seed="0", host="127.0.0.1", port=pool[i].port,
                           name=f"engine-{i}", **kw)


def _wait_visible(pool, index, keys, deadline=10.0):
    """Until sidecar ``index`` sees all ``keys`` somewhere in the pool (summaries are periodic)."""
    client = pool.client(index)
    try:
        end = time.monotonic() + deadline
        while client.lookup(keys, timeout=1.0).hits < len(keys):
            assert time.monotonic() < end, "keys never became visible to the peer"
            time.sleep(0.05)
    finally:
        client.close()


def test_tier_round_trips_chunks_between_two_engines_through_two_sidecars(pool):
    a, b = _engine(pool, 0), _engine(pool, 1)
    try:
        tokens = trace_tokens([11, 12, 13, 14, 15], a.layout.tokens_per_chunk)
        first = a.run_request(tokens)
        assert first.chunks == 5 and first.hit_chunks == 0 and first.stored_chunks == 5
        _wait_visible(pool, 1, a.hasher.chunk_keys(tokens))
        second = b.run_request(tokens)
        assert second.hit_chunks == second.loaded_chunks == 5
        assert second.mismatched_bytes == 0
        # The bytes in engine b's rows are exactly what engine a computed and stored.
        for i, key in enumerate(b.hasher.chunk_keys(tokens)):
            assert bytes(b.region[i, :b.layout.chunk_bytes].numpy()) == \
                bytes(a.expected_row(tokens, i, key).numpy())
        assert b.tier.stats.peer_hits == 5 and b.tier.stats.bytes_loaded == 5 * CONFIG.kv_bytes_per_chunk
        assert pool[1].metric("kv_offload_chunk_lookups_total", result="peer_hit") >= 5
        # A request sharing only the first two chunks loads two and computes the rest.
        third = b.run_request(trace_tokens([11, 12, 99], b.layout.tokens_per_chunk))
        assert (third.hit_chunks, third.loaded_chunks, third.stored_chunks) == (2, 2, 1)
        assert third.mismatched_bytes == 0
    finally:
        a.close()
        b.close()


def test_lookup_the_sidecar_cannot_answer_in_time_becomes_a_miss(pool):
    engine = _engine(pool, 0, lookup_timeout_seconds=0.3, load_timeout_seconds=0.5)
    tier = engine.tier
    tokens = trace_tokens([21, 22], engine.layout.tokens_per_chunk)
    try:
        assert engine.run_request(tokens).stored_chunks == 2  # connected, chunks stored
        keys = engine.hasher.chunk_keys(tokens)
        pool[0].proc.send_signal(signal.SIGSTOP)
        try:
            ctx = ReqContext(req_id="frozen")
            tier.on_new_request(ctx)
            seen = []
            end = time.monotonic() + 10.0
            while not seen or seen[-1] is LookupResult.RETRY:
                assert time.monotonic() < end, "lookup never resolved"
                seen.append(tier.lookup(keys[0], ctx))
                tier.on_schedule_end(None)
                time.sleep(0.02)
            assert seen[0] is LookupResult.RETRY and seen[-1] is LookupResult.MISS
            # A load from the frozen sidecar fails instead of hanging; vLLM recomputes.
            rows = np.array([0], dtype=np.int64)
            tier.submit_load(TransferJob(job_id=7, keys=[keys[0]], chunk_ids=rows,
                                         is_promotion=True, req_context=ctx))
            results = []
            while not results:
                assert time.monotonic() < end, "load never finished"
                results = list(tier.get_finished_jobs())
                time.sleep(0.02)
            assert [(r.job_id, r.success) for r in results] == [(7, False)]
            tier.on_request_finished(ctx)
        finally:
            pool[0].proc.send_signal(signal.SIGCONT)
        # Once the sidecar answers again, the same prefix is a hit again.
        assert engine.run_request(tokens).hit_chunks == 2
    finally:
        engine.close()


def test_tier_is_built_the_way_vllms_factory_builds_out_of_tree_tiers(pool):
    # SecondaryTierFactory: getattr(import_module(module_path), type)(offloading_spec=...,
    # primary_kv_view=..., tier_type=type, **rest of the entry).
    entry = {"type": "KVOffloadSecondaryTier", "module_path": "kv_offload_sidecar.vllm_tier",
             "host": "127.0.0.1", "port": pool[0].port, "enable_kv_events": False}
    config = dict(entry)
    tier_type = config.pop("type")
    cls = getattr(importlib.import_module(config.pop("module_path")), tier_type)
    region = np.zeros((4, 16384), dtype=np.uint8)
    tier = cls(offloading_spec=SimulatedSpec(CONFIG), primary_kv_view=memoryview(region),
               tier_type=tier_type, **config)
    try:
        assert tier.tier_type == "KVOffloadSecondaryTier"
        region[1, :] = np.arange(16384, dtype=np.uint32).astype(np.uint8)
        key = b"\x42" * 32 + b"\x00\x00\x00\x00"
        ctx = ReqContext(req_id="factory")
        tier.submit_store(TransferJob(job_id=1, keys=[key], chunk_ids=np.array([1]),
                                      is_promotion=False, req_context=ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
        tier.submit_load(TransferJob(job_id=2, keys=[key], chunk_ids=np.array([3]),
                                     is_promotion=True, req_context=ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, True)]
        assert bytes(region[3]) == bytes(region[1])
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_an_engine_hashing_with_another_seed_than_its_sidecar_states_is_told_why(pool, caplog):
    client = pool.client(0)
    try:
        assert client.info()["hash_seed"] == "0"  # what LocalPool's sidecars state to peers
    finally:
        client.close()
    same, other = _engine(pool, 0), SimulatedEngine(CONFIG, hash_seed="7", host="127.0.0.1",
                                                    port=pool[0].port, name="engine-seed-7")
    try:
        tokens = trace_tokens([61, 62], same.layout.tokens_per_chunk)
        assert same.run_request(tokens).stored_chunks == 2
        assert same.tier.stats.hash_seed_problem is None
        with caplog.at_level("ERROR", logger="kv_offload_sidecar.vllm_tier"):
            result = other.run_request(tokens)
        # Same tokens, another seed: other keys, so no hit, and the tier says why.
        assert result.hit_chunks == 0 and result.stored_chunks == 2
        problem = other.tier.stats.hash_seed_problem
        assert problem is not None and "PYTHONHASHSEED=7" in problem and "hash seed 0" in problem
        assert any(problem in r.getMessage() for r in caplog.records)
    finally:
        same.close()
        other.close()


def test_hash_seed_problem_names_the_unset_or_differing_seed_and_the_fix():
    assert hash_seed_problem("0", "0") is None
    assert hash_seed_problem("5", None) is None  # a sidecar that does not report its seed
    unset = hash_seed_problem(None, "0")
    assert unset.startswith("PYTHONHASHSEED is not set") and "set PYTHONHASHSEED=0" in unset
    differ = hash_seed_problem("5", "0")
    assert "PYTHONHASHSEED=5" in differ and "set PYTHONHASHSEED=0 here" in differ
    assert "--hash-seed to 5" in differ


def test_unknown_tier_key_is_named_in_the_error():
    region = np.zeros((2, 16384), dtype=np.uint8)
    with pytest.raises(ValueError, match="lookup_timeout"):
        KVOffloadSecondaryTier(SimulatedSpec(CONFIG), memoryview(region), lookup_timout=1)


def test_sidecar_address_adds_the_global_dp_index_and_prefers_tier_keys():
    base = example_config(data_parallel_size=4)
    dp3 = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel,
                                                                 data_parallel_index=3))
    env = {"VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.7", "VLLM_P2P_SIDE_CHANNEL_PORT": "6000"}
    assert sidecar_address(SimulatedSpec(dp3), environ=env) == ("10.0.0.7", 6003)
    assert sidecar_address(SimulatedSpec(dp3), "127.0.0.1", 7000, environ=env) == ("127.0.0.1", 7003)
    assert sidecar_address(SimulatedSpec(CONFIG), environ={}) == ("localhost", 5710)
    with pytest.raises(ValueError, match="VLLM_P2P_SIDE_CHANNEL_PORT"):
        sidecar_address(SimulatedSpec(CONFIG), environ={"VLLM_P2P_SIDE_CHANNEL_PORT": "x"})


def test_tier_module_imports_only_what_install_tier_ships():
    code = ("import sys, json, kv_offload_sidecar.vllm_tier; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    mods = json.loads(out.stdout)
    ours = {m.split(".")[1] + ".py" for m in mods if m.startswith("kv_offload_sidecar.")}
    assert ours <= set(TIER_MODULES), sorted(ours - set(TIER_MODULES))
    for heavy in ("torch", "aiohttp", "prometheus_client", "kopf", "kv_offload_operator"):
        assert heavy not in mods


# The abstract interface of vLLM's tiering/base.py (as read from vLLM), for the import test.
_VLLM_BASE = '''
import enum
from dataclasses import dataclass, field
from typing import Any
class LookupResult(enum.Enum):
    MISS = 1
    HIT = 2
    HIT_PENDING = 3
    RETRY = 4
@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: Any = None
@dataclass
class RequestOffloadingContext:
    policy: str = "chunk_level"
'''
_VLLM_TIERING_BASE = '''
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any
from vllm.v1.kv_offload.base import ReqContext, RequestOffloadingContext
@dataclass
class TransferJob:
    job_id: int
    keys: Any
    chunk_ids: Any
    is_promotion: bool
    req_context: ReqContext
@dataclass
class JobResult:
    job_id: int
    success: bool
class SecondaryTierManager(ABC):
    def __init__(self, offloading_spec, primary_kv_view, tier_type):
        self.offloading_spec = offloading_spec
        self.primary_kv_view = primary_kv_view
        self.tier_type = tier_type
    @abstractmethod
    def on_new_request(self, req_context): ...
    @abstractmethod
    def lookup(self, key, req_context): ...
    @abstractmethod
    def submit_store(self, job): ...
    @abstractmethod
    def submit_load(self, job): ...
    @abstractmethod
    def get_finished_jobs(self): ...
    @abstractmethod
    def drain_jobs(self): ...
    @abstractmethod
    def has_pending_work(self): ...
'''


def test_tier_subclasses_vllms_own_classes_when_vllm_is_importable(tmp_path):
    pkg = tmp_path / "vllm" / "v1" / "kv_offload" / "tiering"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "v1", pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg.parent / "base.py").write_text(_VLLM_BASE)
    (pkg / "base.py").write_text(_VLLM_TIERING_BASE)
    code = """
import numpy as np
import vllm.v1.kv_offload.tiering.base as vt, vllm.v1.kv_offload.base as vb
from kv_offload_sidecar import vllm_tier
from kv_offload_sidecar.local_pool import example_config
from kv_offload_sidecar.engine_sim import SimulatedSpec
assert vllm_tier.VLLM_AVAILABLE
assert issubclass(vllm_tier.KVOffloadSecondaryTier, vt.SecondaryTierManager)
assert vllm_tier.LookupResult is vb.LookupResult and vllm_tier.TransferJob is vt.TransferJob
tier = vllm_tier.KVOffloadSecondaryTier(SimulatedSpec(example_config()),
                                        memoryview(np.zeros((2, 16384), np.uint8)), port=1)
ctx = vb.ReqContext(req_id="r")
assert tier.lookup(b"k" * 36, ctx) is vb.LookupResult.RETRY
tier.shutdown()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
