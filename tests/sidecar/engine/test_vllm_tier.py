"""The vLLM secondary tier, driven through the calls vLLM makes, against real sidecars."""

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from kv_offload_testing.frozen import freeze
from kv_offload_sidecar.engine.sidecar_link import sidecar_address
from kv_offload_sidecar.engine.tier_stats import HIT_STEPS_TARGET
from kv_offload_sidecar.engine.vllm_contract import (
    LookupResult,
    ReqContext,
    TransferJob,
)
from kv_offload_sidecar.engine.vllm_tier import KVOffloadSecondaryTier
from kv_offload_sidecar.commands.install_tier import tier_files
from kv_offload_testing.engine_sim import SimulatedEngine, SimulatedSpec, trace_tokens
from kv_offload_testing.local_pool import LocalPool, example_config
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY
from waiting import wait_for

CONFIG = example_config()


@pytest.fixture(scope="module")
def pool():
    with LocalPool(2, config=CONFIG, publish_interval_seconds=0.05) as p:
        yield p


def _engine(pool, i, **kw):
    return SimulatedEngine(CONFIG, hash_seed="0", host="127.0.0.1", port=pool[i].port,
                           name=f"engine-{i}", **kw)


def _wait_visible(pool, index, keys):
    """Until sidecar ``index`` finds all ``keys`` in the pool (the directory is published
    periodically); asked with the admin lookup, so nothing moves yet."""
    wait_for(f"the keys visible to sidecar {index}", lambda: pool[index].hits(keys) >= len(keys))


def test_tier_round_trips_chunks_between_two_engines_through_two_sidecars(pool):
    a, b = _engine(pool, 0), _engine(pool, 1)
    copies = [pool[i].metric("kv_offload_engine_transfer_seconds_count", op=op, phase="copy")
              for i, op in ((0, "store"), (1, "load"))]
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
        # The engines' rows live in shared files, so the sidecars did the copies (a's store, b's load).
        assert [pool[i].metric("kv_offload_engine_transfer_seconds_count", op=op, phase="copy")
                for i, op in ((0, "store"), (1, "load"))] == [copies[0] + 1, copies[1] + 1]
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
        freeze(pool[0].proc.pid)
        try:
            ctx = ReqContext(req_id="frozen")
            tier.on_new_request(ctx)
            seen = []

            def resolved():  # vLLM asks again every step until the answer is not RETRY
                seen.append(tier.lookup(keys[0], ctx))
                tier.on_schedule_end(None)
                return seen[-1] is not LookupResult.RETRY

            wait_for("the lookup resolved", resolved)
            assert seen[0] is LookupResult.RETRY and seen[-1] is LookupResult.MISS
            # A load from the frozen sidecar fails instead of hanging; vLLM recomputes.
            rows = np.array([0], dtype=np.int64)
            tier.submit_load(TransferJob(job_id=7, keys=[keys[0]], chunk_ids=rows,
                                         is_promotion=True, req_context=ctx))
            results = wait_for("the load finished", lambda: list(tier.get_finished_jobs()))
            assert [(r.job_id, r.success) for r in results] == [(7, False)]
            tier.on_request_finished(ctx)
        finally:
            pool[0].proc.send_signal(signal.SIGCONT)
        # Once the sidecar answers again, the same prefix is a hit again.
        assert engine.run_request(tokens).hit_chunks == 2
    finally:
        engine.close()


def test_tier_is_built_the_way_vllms_factory_builds_out_of_tree_tiers(pool, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # the pool's seed, as the webhook sets it
    # SecondaryTierFactory: getattr(import_module(module_path), type)(offloading_spec=...,
    # primary_kv_view=..., tier_type=type, **rest of the entry).
    entry = {"type": "KVOffloadSecondaryTier", "module_path": "kv_offload_sidecar.engine.vllm_tier",
             "host": "127.0.0.1", "port": pool[0].port, "enable_kv_events": True,
             "locality": "REMOTE",
             # Outside vLLM no VllmConfig builds the tier: the stand-in engine's identity.
             "model_identity": STAND_IN_IDENTITY}
    config = dict(entry)
    tier_type = config.pop("type")
    cls = getattr(importlib.import_module(config.pop("module_path")), tier_type)
    region = np.zeros((4, 16384), dtype=np.uint8)
    tier = cls(offloading_spec=SimulatedSpec(CONFIG), primary_kv_view=memoryview(region),
               tier_type=tier_type, backpressure_detector=None, **config)
    try:
        assert tier.tier_type == "KVOffloadSecondaryTier"
        region[1, :] = np.arange(16384, dtype=np.uint32).astype(np.uint8)
        key = b"\x42" * 32 + b"\x00\x00\x00\x00"
        ctx = ReqContext(req_id="factory")
        tier.submit_store(TransferJob(job_id=1, keys=[key], chunk_ids=np.array([1]),
                                      is_promotion=False, req_context=ctx))
        assert [(r.job_id, r.success) for r in _finished(tier, 1)] == [(1, True)]
        (event,) = tier.take_events()  # enable_kv_events: the stored chunk is announced
        assert (event.keys, event.removed, event.locality.value) == ([key], False, "REMOTE")
        tier.submit_load(TransferJob(job_id=2, keys=[key], chunk_ids=np.array([3]),
                                     is_promotion=True, req_context=ctx))
        assert [(r.job_id, r.success) for r in _finished(tier, 1)] == [(2, True)]
        assert bytes(region[3]) == bytes(region[1])
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def _refused_engine(pool, config, hash_seed, name):
    engine = SimulatedEngine(config, hash_seed=hash_seed, host="127.0.0.1", port=pool[0].port,
                             name=name)
    return engine


def test_an_engine_hashing_with_another_seed_than_its_sidecar_gets_only_misses(pool, caplog):
    client = pool.client(0)
    try:
        assert client.info()["hash_seed"] == "0"  # what LocalPool's sidecars state to peers
    finally:
        client.close()
    same, other = _engine(pool, 0), _refused_engine(pool, CONFIG, "7", "engine-seed-7")
    try:
        tokens = trace_tokens([61, 62], same.layout.tokens_per_chunk)
        assert same.run_request(tokens).stored_chunks == 2
        assert same.tier.stats.refused is None
        stored_before = pool[0].metric("kv_offload_store_used_bytes")
        with caplog.at_level("ERROR", logger="kv_offload_sidecar.engine.vllm_tier"):
            first = other.run_request(tokens)
            second = other.run_request(trace_tokens([63], other.layout.tokens_per_chunk))
        # Fail closed: no hit, nothing stored, and one error line naming the seed.
        assert (first.hit_chunks, first.loaded_chunks, first.stored_chunks) == (0, 0, 0)
        assert (second.hit_chunks, second.stored_chunks) == (0, 0)
        assert other.tier.stats.refused == "hash_seed: '7' != '0'"
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "hash_seed: '7' != '0'" in errors[0]
        assert "refusing the sidecar" in errors[0] and "PYTHONHASHSEED" in errors[0]
        assert pool[0].metric("kv_offload_store_used_bytes") == stored_before
        assert other.tier.stats.bytes_stored == 0 and other.tier.stats.failed_stores >= 1
    finally:
        same.close()
        other.close()


def test_an_engine_whose_config_differs_from_its_sidecars_is_refused_with_a_field_diff(pool, caplog):
    engine_cfg = example_config(model="another/model", tokens_per_hash=32)
    engine = _refused_engine(pool, engine_cfg, "0", "engine-other-config")
    try:
        with caplog.at_level("ERROR", logger="kv_offload_sidecar.engine.vllm_tier"):
            result = engine.run_request(trace_tokens([71, 72], engine.layout.tokens_per_chunk))
        assert (result.hit_chunks, result.stored_chunks) == (0, 0)
        refused = engine.tier.stats.refused
        assert 'model_name: "another/model" != "Qwen/Qwen3-0.6B"' in refused
        assert "tokens_per_hash: 32 != 16" in refused and "hash_seed" not in refused
        assert sum("refusing the sidecar" in r.getMessage() for r in caplog.records) == 1
    finally:
        engine.close()


def test_a_partly_failed_load_reports_what_loaded_and_turns_exactly_the_rest_into_misses(pool):
    engine = _engine(pool, 0)
    tier = engine.tier
    try:
        tokens = trace_tokens([81, 82, 83], engine.layout.tokens_per_chunk)
        keys = engine.hasher.chunk_keys(tokens)
        assert engine.run_request(tokens[:2 * engine.layout.tokens_per_chunk]).stored_chunks == 2
        ctx = ReqContext(req_id="partial")
        tier.on_new_request(ctx)
        results = _lookup_all(tier, keys, ctx)
        assert results == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        # Say the pool had answered HIT for the third too and lost it before the load.
        tier._keys[keys[2]].result = True
        tier.submit_load(TransferJob(job_id=11, keys=keys, chunk_ids=np.array([5, 6, 7]),
                                     is_promotion=True, req_context=ctx))
        (result,) = _finished(tier, 1)
        assert result.job_id == 11 and result.success is False
        assert tuple(result.successful_keys) == tuple(keys[:2])
        assert result.transfer_bytes == 2 * CONFIG.kv_bytes_per_chunk and result.transfer_time > 0
        # vLLM looks the failed key up again: a miss now, so it recomputes instead of
        # promoting it again; the keys that loaded are untouched.
        assert tier.lookup(keys[2], ctx) is LookupResult.MISS
        assert tier.lookup(keys[0], ctx) is LookupResult.HIT
        tier.on_request_finished(ctx)
    finally:
        engine.close()


def _finished(tier, count):
    """The next ``count`` job results, polled as vLLM polls them."""
    out = []

    def all_finished():
        out.extend(tier.get_finished_jobs())
        return len(out) >= count

    wait_for(f"{count} jobs finished", all_finished)
    return out


def _lookup_all(tier, keys, ctx):
    """The lookups of ``keys``, asked again every step (as vLLM does) until none is RETRY."""

    def resolved():
        results = [tier.lookup(k, ctx) for k in keys]
        tier.on_schedule_end(None)
        return None if LookupResult.RETRY in results else results

    return wait_for("the lookups resolved", resolved)


def test_drain_jobs_returns_only_when_every_job_has_finished_or_failed(pool):
    engine = _engine(pool, 1, load_timeout_seconds=0.5)
    tier = engine.tier
    tokens = trace_tokens([91], engine.layout.tokens_per_chunk)
    try:
        assert engine.run_request(tokens).stored_chunks == 1  # connected
        key = engine.hasher.chunk_keys(tokens)[0]
        ctx = ReqContext(req_id="drain")
        freeze(pool[1].proc.pid)
        try:
            for job_id in range(20, 25):
                tier.submit_load(TransferJob(job_id=job_id, keys=[key], chunk_ids=np.array([1]),
                                             is_promotion=True, req_context=ctx))
            start = time.monotonic()
            tier.drain_jobs()
            elapsed = time.monotonic() - start
        finally:
            pool[1].proc.send_signal(signal.SIGCONT)
        # Every job has its result now: the first ran into its deadline, the queued
        # ones were cancelled instead of each waiting out its own.
        results = {r.job_id: r.success for r in tier.get_finished_jobs()}
        assert results == {job_id: False for job_id in range(20, 25)}
        assert not tier.has_pending_work()
        assert elapsed < 5 * 0.5, elapsed
    finally:
        engine.close()


def test_a_store_the_sidecar_cut_short_is_reported_failed_and_not_stored(pool):
    engine = _engine(pool, 1)
    tier = engine.tier
    tokens_per_chunk = engine.layout.tokens_per_chunk
    try:
        assert engine.run_request(trace_tokens([131], tokens_per_chunk)).stored_chunks == 1
        keys = engine.hasher.chunk_keys(trace_tokens([132, 133], tokens_per_chunk))
        ctx = ReqContext(req_id="cut")
        failed = tier.stats.failed_stores
        # What drain_jobs sends for a running store, here before the store comes.
        with pool.client(1) as other:
            assert other.cancel([tier._transfers.sidecar_job_id(61)]) == 0
        tier.submit_store(TransferJob(job_id=61, keys=keys, chunk_ids=np.array([4, 5]),
                                      is_promotion=False, req_context=ctx))
        assert [(r.job_id, r.success) for r in _finished(tier, 1)] == [(61, False)]
        assert tier.stats.failed_stores == failed + 1
        assert pool[1].held(keys)[0] == 0
        tier.submit_store(TransferJob(job_id=62, keys=keys, chunk_ids=np.array([4, 5]),
                                      is_promotion=False, req_context=ctx))
        assert [(r.job_id, r.success) for r in _finished(tier, 1)] == [(62, True)]
        assert pool[1].held(keys)[0] == 2
    finally:
        engine.close()


@pytest.mark.parametrize("device_type, paced, tokens", [("cpu", True, 141), ("cuda", False, 142),
                                                        (None, True, 143)], ids=["cpu", "gpu", "unknown"])
def test_stores_are_paced_only_beside_an_engine_that_computes_on_the_host_cpu(pool, monkeypatch,
                                                                              device_type, paced, tokens):
    if device_type is None:  # not inside vLLM: the platform cannot be read
        monkeypatch.delitem(sys.modules, "vllm.platforms", raising=False)
    else:  # vLLM's platform object as the tier reads it in vLLM's process
        monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(
            current_platform=types.SimpleNamespace(device_type=device_type)))
    engine = _engine(pool, 0)
    try:
        assert engine.tier._transfers.paces_stores is paced
        assert engine.run_request(trace_tokens([tokens], engine.layout.tokens_per_chunk)).stored_chunks == 1
        assert engine.tier.stats.paced_stores == int(paced)
    finally:
        engine.close()


def test_shutdown_releases_every_view_of_the_primary_region_so_vllm_can_close_it(pool, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    import mmap
    path = tmp_path / "region"
    path.write_bytes(b"\0" * (4 * 16384))
    with open(path, "r+b") as fh:
        region = mmap.mmap(fh.fileno(), 4 * 16384)
    view = memoryview(np.frombuffer(region, dtype=np.uint8).reshape(4, 16384))
    tier = KVOffloadSecondaryTier(SimulatedSpec(CONFIG), view, host="127.0.0.1", port=pool[0].port,
                                  model_identity=STAND_IN_IDENTITY)
    key = b"\x43" * 32 + b"\x00\x00\x00\x00"
    ctx = ReqContext(req_id="views")
    tier.submit_store(TransferJob(job_id=1, keys=[key], chunk_ids=np.array([0]),
                                  is_promotion=False, req_context=ctx))
    # vLLM loads a key once its store finished (stores and loads run on threads of their own).
    assert [(r.job_id, r.success) for r in _finished(tier, 1)] == [(1, True)]
    tier.submit_load(TransferJob(job_id=2, keys=[key], chunk_ids=np.array([1]),
                                 is_promotion=True, req_context=ctx))
    assert [(r.job_id, r.success) for r in _finished(tier, 1)] == [(2, True)]
    tier.shutdown()
    # What vLLM does at its own shutdown: release its view, then close the mmap.
    view.release()
    import gc
    gc.collect()
    region.close()  # BufferError if the tier still held a view
    assert region.closed


def test_unknown_tier_key_is_named_in_the_error():
    region = np.zeros((2, 16384), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"\['lookup_timout'\].*valid keys: host, port, lookup_timeout"):
        KVOffloadSecondaryTier(SimulatedSpec(CONFIG), memoryview(region), lookup_timout=1)
    with pytest.raises(ValueError, match=r"locality 'NEARBY' is not one of \['LOCAL', 'REMOTE'\]"):
        KVOffloadSecondaryTier(SimulatedSpec(CONFIG), memoryview(region), locality="NEARBY")


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
    code = ("import sys, json, kv_offload_sidecar.engine.vllm_tier; "
            "print(json.dumps({m: getattr(sys.modules[m], '__file__', None) for m in sorted(sys.modules)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    mods = json.loads(out.stdout)
    # Modules of ours that got imported, as files relative to the package (a package is its __init__.py).
    package = Path(mods["kv_offload_sidecar"]).parent
    ours = {Path(f).relative_to(package).as_posix() for m, f in mods.items() if m.startswith("kv_offload_sidecar.")}
    assert "engine/contract/ports.py" in ours  # the contract is shipped too, from its subfolder
    shipped = {p.as_posix() for p in tier_files()}
    assert ours <= shipped, sorted(ours - shipped)
    for heavy in ("torch", "aiohttp", "prometheus_client", "kopf", "kv_offload_operator",
                  "xxhash", "kv_offload_tools"):
        assert heavy not in mods

def test_a_new_tier_hands_its_region_to_the_sidecar_before_its_first_lookup(pool):
    engine = SimulatedEngine(CONFIG, hash_seed="0", host="127.0.0.1", port=pool[0].port,
                             name="attaches-early")
    try:
        def sidecar_maps_the_rows():  # the sidecar maps the engine's memfd rows once the tier attached
            with open(f"/proc/{pool[0].proc.pid}/maps") as fh:
                return any("kv-offload-sim-attaches-early" in line for line in fh)

        wait_for("the tier's region handed to the sidecar", sidecar_maps_the_rows)
        assert engine.tier.stats.lookups == 0 and engine.tier.sidecar_instance is None
    finally:
        engine.close()


def test_a_peer_hit_answered_while_vllm_retries_is_hit_at_its_next_lookup_and_counted_from_the_answer(pool):
    a, b = _engine(pool, 0), _engine(pool, 1, lookup_timeout_seconds=60.0)
    tier = b.tier
    try:
        tokens = trace_tokens([101, 102, 103], a.layout.tokens_per_chunk)
        assert a.run_request(tokens).stored_chunks == 3
        keys = a.hasher.chunk_keys(tokens)
        _wait_visible(pool, 1, keys)
        b.run_request(trace_tokens([104], b.layout.tokens_per_chunk))  # b's tier attached, checked
        before = dataclasses.replace(tier.stats)
        for extra_steps, req_id in ((0, "on-time"), (HIT_STEPS_TARGET, "two-steps"),
                                    (HIT_STEPS_TARGET + 1, "late")):
            ctx = ReqContext(req_id=req_id)
            tier.on_new_request(ctx)
            freeze(pool[1].proc.pid)
            try:
                for _ in range(3):  # vLLM retries every step while its sidecar works
                    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
                    tier.on_schedule_end(None)
                    assert tier.lookups_in_flight == 1
            finally:
                pool[1].proc.send_signal(signal.SIGCONT)  # the sidecar answers: the "arrival"
            wait_for("the sidecar's answer in the tier", lambda: tier.lookups_in_flight == 0)
            for _ in range(extra_steps):  # steps in which vLLM did not ask again
                tier.on_schedule_end(None)
            # The very next lookup has the answer: no poll interval between answer and HIT.
            assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
            tier.on_request_finished(ctx)
            # The first lookup's fetch lands in the background; the next request stops the
            # sidecar again, so it must have landed first for the next lookups to be local.
            wait_for("the fetched chunks in sidecar 1's own store",
                     lambda: pool[1].held(keys)[0] == len(keys))
        stats = tier.stats
        # The first request's lookup fetched the chunks: the next two found them in sidecar 1.
        assert (stats.peer_hits - before.peer_hits, stats.local_hits - before.local_hits) == (3, 6)
        assert stats.lookup_arrivals - before.lookup_arrivals == 3
        assert stats.lookup_steps_after_arrival - before.lookup_steps_after_arrival == \
            0 + HIT_STEPS_TARGET + HIT_STEPS_TARGET + 1
        assert stats.lookup_late_arrivals - before.lookup_late_arrivals == 1
    finally:
        a.close()
        b.close()


@pytest.fixture
def patient_pool():
    """Sidecars that wait up to a minute for a peer: only a cancel ends a stalled fetch sooner."""
    with LocalPool(2, config=CONFIG, publish_interval_seconds=0.05,
                   fetch_deadline_seconds=60.0) as p:
        yield p


def _held_by_a_patient_peer(pool, a, b, seed):
    """Engine a stores two chunks (seeds ``seed``, ``seed + 1``) that sidecar 1 then finds at
    sidecar 0, and b's tier is attached; their keys and a request context open in b's tier."""
    tokens = trace_tokens([seed, seed + 1], a.layout.tokens_per_chunk)
    assert a.run_request(tokens).stored_chunks == 2
    keys = a.hasher.chunk_keys(tokens)
    _wait_visible(pool, 1, keys)
    b.run_request(trace_tokens([seed + 2], b.layout.tokens_per_chunk))  # b's tier attached, checked
    ctx = ReqContext(req_id="stalled")
    b.tier.on_new_request(ctx)
    return keys, ctx


def test_drain_jobs_cancels_a_load_stalled_on_a_peer_instead_of_waiting_out_its_deadline(
        patient_pool):
    pool = patient_pool
    a, b = _engine(pool, 0), _engine(pool, 1, load_timeout_seconds=60.0)
    tier = b.tier
    try:
        keys, ctx = _held_by_a_patient_peer(pool, a, b, 111)
        freeze(pool[0].proc.pid)  # the holder stalls: the fetch hangs
        try:
            tier.submit_load(TransferJob(job_id=31, keys=keys, chunk_ids=np.array([2, 3]),
                                         is_promotion=True, req_context=ctx))
            tier.submit_load(TransferJob(job_id=32, keys=keys, chunk_ids=np.array([4, 5]),
                                         is_promotion=True, req_context=ctx))
            wait_for("the first load taken up", lambda: tier.transfers_in_flight == (2, 1))
            start = time.monotonic()
            tier.drain_jobs()  # what vLLM's reset_cache does
            elapsed = time.monotonic() - start
        finally:
            pool[0].proc.send_signal(signal.SIGCONT)
        # Both failed (vLLM recomputes), the running one cancelled by b's sidecar, which
        # answered: drain_jobs did not wait for the load's 60 s deadline.
        assert {r.job_id: r.success for r in tier.get_finished_jobs()} == {31: False, 32: False}
        assert tier.transfers_in_flight == (0, 0) and elapsed < 30.0, elapsed
        tier.on_request_finished(ctx)
    finally:
        a.close()
        b.close()


def test_a_load_from_a_stalled_peer_ends_as_a_miss_and_a_store_beside_it_lands(patient_pool):
    """The holder stops (SIGSTOP) under a load with a 60 s deadline: the load does not hang on
    it (the sidecar stops waiting for a silent peer's answer, ``peers/liveness.py``) and ends
    as a miss, while a store submitted beside it lands (loads and stores have a thread each)."""
    pool = patient_pool
    a, b = _engine(pool, 0), _engine(pool, 1, load_timeout_seconds=60.0)
    tier = b.tier
    try:
        keys, ctx = _held_by_a_patient_peer(pool, a, b, 121)
        new_keys = b.hasher.chunk_keys(trace_tokens([124, 125], b.layout.tokens_per_chunk))
        results = {}
        freeze(pool[0].proc.pid)  # the holder stalls
        try:
            tier.submit_load(TransferJob(job_id=41, keys=keys, chunk_ids=np.array([2, 3]),
                                         is_promotion=True, req_context=ctx))
            tier.submit_store(TransferJob(job_id=42, keys=new_keys, chunk_ids=np.array([4, 5]),
                                          is_promotion=False, req_context=ctx))

            def both_done() -> bool:
                results.update({r.job_id: r.success for r in tier.get_finished_jobs()})
                return len(results) == 2

            # Within half the load's 60 s deadline: the stalled holder is given up, not waited on.
            wait_for("the load given up and the store landed", both_done, timeout=30.0)
            assert results == {41: False, 42: True}
            tier.drain_jobs()
        finally:
            pool[0].proc.send_signal(signal.SIGCONT)
        assert pool[1].held(new_keys)[0] == 2  # the store landed in b's own sidecar
        tier.on_request_finished(ctx)
    finally:
        a.close()
        b.close()


def _burn_cpu(seconds):
    """Spend ``seconds`` of this thread's CPU (its own clock: a state, not a guess)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_tier_counts_the_cpu_of_its_threads_and_its_calls_and_not_the_rest_of_the_process(
        pool, monkeypatch):
    engine = _engine(pool, 1)
    tier = engine.tier
    try:
        engine.run_request(trace_tokens([121], engine.layout.tokens_per_chunk))  # attached
        spent = lambda: tier.stats.cpu_seconds  # noqa: E731
        before = spent()
        _burn_cpu(0.2)  # vLLM's own work in the process, outside the tier
        assert spent() - before < 0.2
        ctx = ReqContext(req_id="cpu")
        tier.on_new_request(ctx)
        # The scheduler thread inside a tier call.
        monkeypatch.setattr(tier, "_drain_lookup_results", lambda: _burn_cpu(0.2))
        before = spent()
        tier.lookup(b"\x01" * 16, ctx)
        assert spent() - before >= 0.2
        # The tier's transfer thread.
        monkeypatch.setattr(tier._transfers, "_store", lambda job: (_burn_cpu(0.2), (True, 0))[1])
        before = spent()
        tier.submit_store(TransferJob(job_id=41, keys=[b"\x02" * 16], chunk_ids=np.array([0]),
                                      is_promotion=False, req_context=ctx))
        assert wait_for("the store job finished", lambda: list(tier.get_finished_jobs()))
        assert spent() - before >= 0.2
        tier.on_request_finished(ctx)
    finally:
        engine.close()
