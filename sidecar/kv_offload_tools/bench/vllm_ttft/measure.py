"""The measurements of `bench vllm` on one data plane: two pods, each a real vLLM engine
beside its sidecar (engine A with sidecar 0, engine B with sidecar 1).

Per prefix size, in this order and with one prompt (2 and 3 in turns, ``HIT_RUNS`` times
each, and so 4 and 5, each figure the median hit: ``vllm_ttft_figures.median_hit``):

1. recompute: A computes the prompt (nothing offloaded holds it). vLLM then
   stores its chunks into its primary CPU tier and cascades them to the tier,
   i.e. into sidecar 0: the *store*, timed from the request's start until vLLM
   counts the tier's write bytes, with the CPU A's engine core and sidecar 0 spent.
2. cpu_tier: ``reset_prefix_cache()`` on A, same prompt: vLLM's own CPU-tier hit.
3. own_sidecar: ``reset_prefix_cache(reset_connector=True)`` on A (vLLM's tiering
   manager empties its primary tier; secondary tiers keep their chunks), same
   prompt: the chunks come from the pod's own sidecar.
4. peer: once sidecar 1's directory knows sidecar 0's chunks, B asks for the
   prompt: lookup until vLLM sees HIT and the scheduler steps from the sidecar
   knowing the hit to that HIT (the tier's counters), fetch from the peer and copy
   into vLLM's rows (sidecar 1's transfer histogram).
5. peer_cpu_tier: ``reset_prefix_cache()`` on B, same prompt: B's own CPU-tier hit of
   what the peer hit loaded, the reference of the peer hit's extra (the own-sidecar
   hit's is A's CPU-tier hit): each sidecar hit against vLLM's own on the same engine.

Before anything is timed on one engine, the bench waits until the other is idle
(``settle``): here both share the engines' cores, and vLLM's processes keep polling for
about a second after a request, which slowed the other engine's decode steps up to 2.5x
and its TTFT by tens of ms; two pods on a node each have CPUs of their own.

Every first token is compared with the baseline engine's (no offloading). Engine
CPU is the engine-core process's (``/proc``) and, within it, the tier's own code
(``vllm:kv_offload_tier_cpu_seconds``): vLLM steps while a request waits for KV, so
the process total grows with how long a transfer takes, the tier's share with what
the tier does.
Inter-token latency: B decodes a short request while (quiet) nothing else
runs, (load) B loads a large prefix A computed, until its first token, (store) B
computes a large prefix, until vLLM counts its bytes written to the tier
(``decode_latency`` op); load and store each ``WINDOW_RUNS`` times beside a fresh
prefix, the median window by p99 (``median_window``) standing for them; the quiet run,
``QUIET_TOKENS`` tokens, is made before and after the others and both are pooled, since
a shared host drifts. One more run, ``memcpy_beside``, decodes as quietly while the
bench repeats a bare memcpy of the prefix's bytes on the sidecars' cores: the cores share
one memory bus, so any byte movement beside the engine slows its decoding, and that run
says by how much.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from kv_offload_tools.bench.vllm_ttft.figures import (
    engine_cpu,
    itl_stats,
    itl_window,
    median_hit,
    median_window,
    per_gb,
    per_wait,
)
from kv_offload_tools.bench.vllm_ttft.plan import (
    CHUNK_TOKENS,
    HIT_RUNS,
    WINDOW_RUNS,
    Plan,
    decode_prompt,
    itl_role,
    prefix_prompt,
    prompt_key,
)
from kv_offload_tools.bench.vllm_ttft.probes import (
    LOOKUP_ARRIVALS,
    LOOKUP_LATE_ARRIVALS,
    LOOKUP_STEPS_AFTER_ARRIVAL,
    LOOKUP_WAIT_MS,
    LOOKUP_WAIT_STEPS,
    LOOKUP_WAITS,
    TIER_CHUNK_HITS,
    TIER_READ_BYTES,
    TIER_WRITE_BYTES,
    Probe,
    delta,
    descendant,
    tree_cpu_seconds,
    vllm_value,
)
from kv_offload_tools.bench.vllm_ttft.refs import memcpy_loop
from kv_offload_tools.vllm_harness.decode_latency import store_bound_s

# Seconds to wait for a store to reach the sidecar, or the pool's directory to converge.
_STORE_DEADLINE_S = 120.0
# Polling interval of those waits.
_POLL_S = 0.02
# The other engine is idle once its processes spend at most this share of a core over
# _IDLE_WINDOW_S seconds (vLLM's processes keep polling for about a second after a request).
_IDLE_CORE_SHARE = 0.1
_IDLE_WINDOW_S = 0.2
# Longest wait for the other engine to go idle: a safety net, counted in the report if hit.
_IDLE_DEADLINE_S = 15.0
# Tokens the decoding request decodes after its warm-up in each quiet run (two runs pooled:
# 64 intervals, about what a 512 MiB load or store window holds here).
QUIET_TOKENS = 32
# Tokens the decoding request decodes before the traffic request is added.
WARM_TOKENS = 8


def progress(message: str) -> None:
    print(f"[bench vllm] {message}", file=sys.stderr, flush=True)


class PlaneBench:
    """Measurements on one plane's pool of two sidecars and engines A and B."""

    def __init__(self, plan: Plan, plane: str, pool: Any, a: Any, b: Any,
                 expected: Mapping[str, list[int]], tier_label: str, stride_bytes: int) -> None:
        self.plan, self.plane, self.pool, self.a, self.b = plan, plane, pool, a, b
        self.expected = expected
        self.tier_label = tier_label
        # Bytes vLLM counts per chunk it writes to or reads from the tier.
        self.stride_bytes = stride_bytes
        pids = {"sidecar_0": pool[0].proc.pid, "sidecar_1": pool[1].proc.pid}
        for role, eng in (("engine_a", a), ("engine_b", b)):
            core = descendant(eng.pid, "VLLM::EngineCor")
            if core is None:
                raise RuntimeError(f"no VLLM::EngineCore process under the driver {eng.pid}")
            pids[role] = core
        self.pids = pids
        # Each engine's driver, the root of its processes.
        self.engine_roots = {"a": a.pid, "b": b.pid}
        # Times a request was timed with the other engine still busy (its idle wait ran out).
        self.busy_neighbour = 0
        self.probe = Probe(pids, {"a": a, "b": b}, {"sidecar_0": pool[0], "sidecar_1": pool[1]},
                           tier_label)
        self.mismatches: list[dict[str, Any]] = []

    # ---- helpers -------------------------------------------------------------

    def _check(self, what: str, key: str, out: Mapping[str, Any]) -> bool:
        want = self.expected[key][:len(out["token_ids"])]
        ok = out["token_ids"] == want
        if not ok:
            self.mismatches.append({"plane": self.plane, "what": what, "prompt": key,
                                    "got": out["token_ids"], "baseline": want})
            progress(f"MISMATCH {self.plane} {what}: first token {out['token_ids']} "
                     f"!= baseline {want}")
        return ok

    def tier_counter(self, engine: Any, name: str) -> float:
        return vllm_value(engine.metrics(raw=True), name, tier=self.tier_label) or 0.0

    def _wait(self, what: str, done: Callable[[], bool], timeout: float = _STORE_DEADLINE_S) -> None:
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() > end:
                raise TimeoutError(f"{self.plane}: timed out waiting for {what}")
            time.sleep(_POLL_S)

    def wait_written(self, engine: Any, before: float, chunks: int) -> None:
        """Until vLLM counts ``chunks`` more chunks written to the tier (cascaded to its sidecar)."""
        want = before + chunks * self.stride_bytes
        self._wait("the store to reach the sidecar",
                   lambda: self.tier_counter(engine, TIER_WRITE_BYTES) >= want)

    def settle(self, role: str) -> None:
        """Until engine ``role`` ("a" or "b") is idle: both engines share the engines' cores
        here, and vLLM's processes keep polling for about a second after a request (up to
        2.5x the other engine's decode steps and tens of ms of its TTFT measured so), which
        two pods on a GPU node, each with CPUs of its own, do not pay. Called before
        anything is timed on the other engine."""
        root, end = self.engine_roots[role], time.monotonic() + _IDLE_DEADLINE_S
        last = tree_cpu_seconds(root)
        while True:
            time.sleep(_IDLE_WINDOW_S)
            now = tree_cpu_seconds(root)
            if now - last <= _IDLE_CORE_SHARE * _IDLE_WINDOW_S:
                return
            if time.monotonic() > end:
                self.busy_neighbour += 1
                progress(f"WARNING {self.plane}: engine {role.upper()} still busy after "
                         f"{_IDLE_DEADLINE_S:.0f} s; timing the other engine beside it")
                return
            last = now

    def _hit(self, engine: Any, role: str, prompt: list[int], key: str, what: str,
             vllm_roles: tuple[str, ...]) -> dict[str, Any]:
        """One request with max_tokens=1 and the counters around it, the other engine idle."""
        self.settle("b" if role == "a" else "a")
        before = self.probe.snapshot(vllm_roles)
        (out,) = engine.generate([prompt], max_tokens=1)
        ttft = engine.last_generate_s
        d = delta(before, self.probe.snapshot(vllm_roles))
        hit = out["num_cached_tokens"] >= len(prompt) - 1 - CHUNK_TOKENS
        if not hit:
            progress(f"WARNING {self.plane} {what}: only {out['num_cached_tokens']} of "
                     f"{len(prompt)} tokens cached: not a full hit")
        return {"ttft_s": ttft, "num_cached_tokens": out["num_cached_tokens"],
                "first_token": out["token_ids"][:1], "match": self._check(what, key, out),
                "delta": d, "role": role, "hit": hit}

    def warm(self, prompt: list[int]) -> None:
        """One small store, own-sidecar hit and peer hit, so first-request costs (kernels,
        connections) stay out of the measurements."""
        a, b = self.a, self.b
        written = self.tier_counter(a, TIER_WRITE_BYTES)
        a.generate([prompt], max_tokens=1)
        self.wait_written(a, written, len(prompt) // CHUNK_TOKENS)
        a.reset_prefix_cache(reset_connector=True)
        a.generate([prompt], max_tokens=1)
        self.pool.wait_directory_current(timeout=_STORE_DEADLINE_S)
        b.generate([prompt], max_tokens=1)

    # ---- one prefix size ----------------------------------------------------------

    def measure_size(self, size_mib: int) -> dict[str, Any]:
        plan, a, b = self.plan, self.a, self.b
        key = prompt_key(size_mib)
        prompt = prefix_prompt(plan, size_mib)
        tokens = plan.prefix_tokens(size_mib)
        nbytes = plan.prefix_bytes(size_mib)
        chunks = tokens // CHUNK_TOKENS
        row: dict[str, Any] = {"plane": self.plane, "size_mib": size_mib, "tokens": tokens,
                               "bytes": nbytes, "chunks": chunks}

        # 1. recompute on A, then its store into sidecar 0.
        # The prefill is one step and vLLM stores a request's blocks after the step that
        # computed them, so the store is timed (and its CPU counted) from the first token on.
        written = self.tier_counter(a, TIER_WRITE_BYTES)
        self.settle("b")
        t0 = time.monotonic()
        (out,) = a.generate([prompt], max_tokens=1)
        ttft = a.last_generate_s
        before = self.probe.snapshot(("a",))
        t1 = time.monotonic()
        row["recompute"] = {"ttft_s": ttft, "num_cached_tokens": out["num_cached_tokens"],
                            "first_token": out["token_ids"][:1],
                            "match": self._check("recompute", key, out)}
        self.wait_written(a, written, chunks)
        store_s = time.monotonic() - t1
        d = delta(before, self.probe.snapshot(("a",)))
        row["store"] = self._cost(d, nbytes, "engine_a", "sidecar_0", "store", seconds=store_s)
        row["store"]["seconds_from_request_start"] = time.monotonic() - t0
        progress(f"{self.plane} {size_mib} MiB: recompute {ttft:.3f} s; in sidecar 0 "
                 f"{store_s:.3f} s after the first token")

        # 2. and 3., HIT_RUNS times in turns: vLLM's own CPU tier, then the pod's own sidecar
        # with vLLM's primary tier emptied (whose hit fills it again for the next CPU-tier hit).
        cpu, own = [], []
        for _ in range(HIT_RUNS):
            a.reset_prefix_cache()
            hit = self._hit(a, "a", prompt, key, "cpu_tier", ("a",))
            cpu.append(self._summary(hit, nbytes, "engine_a", None, None))
            a.reset_prefix_cache(reset_connector=True)
            hit = self._hit(a, "a", prompt, key, "own_sidecar", ("a",))
            own.append(self._summary(hit, nbytes, "engine_a", "sidecar_0", "a"))
        row["cpu_tier"], row["own_sidecar"] = median_hit(cpu), median_hit(own)

        # 4. a peer hit: B loads what A's sidecar holds. B's first prompt this long pays the
        # engine's own first-time costs of a context that long (A paid them in its recompute):
        # that hit is kept apart (peer_cold), and the peer hit is timed again with B's prefix
        # cache and primary tier emptied (its sidecar kept no copy of what it fetched, so the
        # chunks come from sidecar 0 again), like for like with A's CPU-tier hit.
        # 5. in turns with it, B's own CPU-tier hit: the peer hit left the prefix in B's
        # primary tier. The peer hit's extra is taken over this one, same engine and same
        # promotion work (the two engines' CPU-tier hits differ by tens of ms on this host).
        self.pool.wait_directory_current(timeout=_STORE_DEADLINE_S)
        row["peer_cold"] = self._peer_hit(prompt, key, nbytes)
        peers, peer_cpu = [], []
        for _ in range(HIT_RUNS):
            b.reset_prefix_cache(reset_connector=True)
            peers.append(self._peer_hit(prompt, key, nbytes))
            b.reset_prefix_cache()
            hit = self._hit(b, "b", prompt, key, "peer_cpu_tier", ("b",))
            peer_cpu.append(self._summary(hit, nbytes, "engine_b", None, "b"))
        row["peer"] = peer = median_hit(peers)
        row["peer_cpu_tier"] = median_hit(peer_cpu)
        for source, base in (("own_sidecar", "cpu_tier"), ("peer", "peer_cpu_tier")):
            extra = row[source]["ttft_s"] - row[base]["ttft_s"]
            row[source]["extra_over_cpu_tier_s"] = extra
            row[source]["rate_gbps"] = nbytes / 1e9 / extra if extra > 0 else None
        progress(f"{self.plane} {size_mib} MiB (median of [runs]): cpu tier "
                 f"{_ttfts(row['cpu_tier'])} (B's {_ttfts(row['peer_cpu_tier'])}), own sidecar "
                 f"{_ttfts(row['own_sidecar'])}, peer {_ttfts(peer)} "
                 f"(B's first prompt this long {row['peer_cold']['ttft_s']:.3f} s) "
                 f"(lookup {_fmt_ms(peer['lookup_ms'])} in {_fmt(peer['lookup_steps'])} steps, "
                 f"HIT {_fmt(peer['steps_after_arrival'])} steps after the sidecar knew it, "
                 f"fetch {_fmt_s(peer['phases'].get('load.fetch'))}, "
                 f"copy {_fmt_s(peer['phases'].get('load.copy'))}, lookup to last chunk landed "
                 f"{_fmt_s(peer['phases'].get('load.lookup_to_landed'))})")
        return row

    def _peer_hit(self, prompt: list[int], key: str, nbytes: int) -> dict[str, Any]:
        """B's hit of what sidecar 0 holds, with the holder's CPU and what sidecar 1 fetched."""
        hit = self._hit(self.b, "b", prompt, key, "peer", ("b",))
        peer = self._summary(hit, nbytes, "engine_b", "sidecar_1", "b")
        peer["holder_cpu_s"] = hit["delta"]["cpu_s"].get("sidecar_0")
        peer["peer_bytes_received"] = hit["delta"]["sidecar"]["sidecar_1"]["peer_bytes_received"]
        peer["sidecar_peer_hits"] = hit["delta"]["sidecar"]["sidecar_1"]["peer_hit"]
        return peer

    def _cost(self, d: Mapping[str, Any], nbytes: int, engine_role: str, sidecar_role: str,
              op: str, seconds: float) -> dict[str, Any]:
        sidecar_cpu = d["cpu_s"].get(sidecar_role)
        phases = {k: v for k, v in d["phases"].get(sidecar_role, {}).items()
                  if k.startswith(f"{op}.")}
        return {"seconds": seconds, "rate_gbps": nbytes / 1e9 / seconds if seconds > 0 else None,
                **engine_cpu(d, engine_role, nbytes), "sidecar_cpu_s": sidecar_cpu,
                "sidecar_cpu_s_per_gb": per_gb(sidecar_cpu, nbytes), "phases": phases}

    def _summary(self, hit: Mapping[str, Any], nbytes: int, engine_role: str,
                 sidecar_role: str | None, vllm_role: str | None) -> dict[str, Any]:
        d = hit["delta"]
        out: dict[str, Any] = {k: hit[k] for k in ("ttft_s", "num_cached_tokens", "first_token",
                                                   "match", "hit")}
        out.update(engine_cpu(d, engine_role, nbytes))
        if sidecar_role is not None:
            cost = self._cost(d, nbytes, engine_role, sidecar_role, "load", hit["ttft_s"])
            out["sidecar_cpu_s"] = cost["sidecar_cpu_s"]
            out["sidecar_cpu_s_per_gb"] = cost["sidecar_cpu_s_per_gb"]
            out["phases"] = cost["phases"]
        if vllm_role is not None:
            v = d["vllm"]
            waits = v.get(f"{vllm_role}:{LOOKUP_WAITS}")
            wait_ms = v.get(f"{vllm_role}:{LOOKUP_WAIT_MS}")
            steps = v.get(f"{vllm_role}:{LOOKUP_WAIT_STEPS}")
            arrivals = v.get(f"{vllm_role}:{LOOKUP_ARRIVALS}")
            # vLLM shows a counter once it first grows: beside the arrivals it is 0 until then.
            after, late = (v.get(f"{vllm_role}:{name}") for name in
                           (LOOKUP_STEPS_AFTER_ARRIVAL, LOOKUP_LATE_ARRIVALS))
            if arrivals is not None:
                after, late = after or 0.0, late or 0.0
            out["lookup_waits"] = waits
            out["lookup_ms"] = per_wait(wait_ms, waits, waits)
            out["lookup_steps"] = per_wait(steps, waits, waits)
            out["lookup_arrivals"] = arrivals
            out["steps_after_arrival"] = per_wait(after, arrivals, waits)
            out["late_arrivals"] = late
            out["tier_chunk_hits"] = v.get(f"{vllm_role}:{TIER_CHUNK_HITS}")
            out["tier_read_bytes"] = v.get(f"{vllm_role}:{TIER_READ_BYTES}")
        return out

    # ---- inter-token latency ------------------------------------------------------------

    def inter_token(self, size_mib: int) -> dict[str, Any]:
        """B decodes a short request: alone, while loading a prefix from A's sidecar (until
        its first token), and while computing and storing another prefix (until vLLM counts
        its bytes written to the tier); ``WINDOW_RUNS`` load and store windows, each beside a
        fresh prefix, whose p99s' median is the figure (``median_window``)."""
        kwargs = {"warm_tokens": WARM_TOKENS, "quiet_tokens": QUIET_TOKENS,
                  "max_decode_tokens": self.plan.max_decode_tokens}
        runs: dict[str, Any] = {}
        b = self.b
        self.settle("a")
        quiet = [b.decode_latency(decode_prompt("quiet"), None, **kwargs)]
        loads, stores = [], []
        for run in range(WINDOW_RUNS):
            loads.append(self._load_window(size_mib, itl_role("load", run), kwargs))
            stores.append(self._store_window(size_mib, itl_role("store", run), kwargs))
        runs["load"], runs["store"] = median_window(loads), median_window(stores)
        # The same bytes copied over and over on the sidecars' cores, no offload traffic: what
        # the memory bus the cores share costs decoding, whatever moves the bytes.
        chunks = self.plan.prefix_tokens(size_mib) // CHUNK_TOKENS
        with memcpy_loop(chunks * self.stride_bytes, os.sched_getaffinity(self.pids["sidecar_0"])):
            self.settle("a")
            beside = b.decode_latency(decode_prompt("quiet"), None, **kwargs)
        runs["memcpy_beside"] = self._itl_pooled([beside])
        # The quiet reference brackets the traffic runs (a busy host drifts): both pooled.
        self.settle("a")
        quiet.append(b.decode_latency(decode_prompt("quiet"), None, **kwargs))
        runs["quiet"] = self._itl_pooled(quiet)
        q99 = runs["quiet"]["p99_ms"]
        for name in ("load", "store", "memcpy_beside"):
            p99 = runs[name]["p99_ms"]
            runs[name]["p99_over_quiet"] = p99 / q99 if p99 is not None and q99 else None
        progress(f"{self.plane} inter-token ({size_mib} MiB): p50/p99 quiet "
                 f"{_fmt(runs['quiet']['p50_ms'])}/{_fmt(q99)} ms, load "
                 f"{_fmt(runs['load']['p50_ms'])}/{_fmt(runs['load']['p99_ms'])} ms, store "
                 f"{_fmt(runs['store']['p50_ms'])}/{_fmt(runs['store']['p99_ms'])} ms, a bare "
                 f"memcpy loop beside {_fmt(runs['memcpy_beside']['p50_ms'])}/"
                 f"{_fmt(runs['memcpy_beside']['p99_ms'])} ms "
                 f"(each window's p99: load {_p99s(loads)}, store {_p99s(stores)} ms; ended: "
                 f"load {_ends(loads)}, store {_ends(stores)})")
        return {"plane": self.plane, "size_mib": size_mib, **runs}

    def _load_window(self, size_mib: int, role: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A computes a fresh prefix and stores it; B decodes while loading it from A's sidecar."""
        a, b = self.a, self.b
        key, traffic = prompt_key(size_mib, role), prefix_prompt(self.plan, size_mib, role)
        chunks = self.plan.prefix_tokens(size_mib) // CHUNK_TOKENS
        written = self.tier_counter(a, TIER_WRITE_BYTES)
        (out,) = a.generate([traffic], max_tokens=1)
        self._check(f"itl {role} prompt on A", key, out)
        self.wait_written(a, written, chunks)
        self.pool.wait_directory_current(timeout=_STORE_DEADLINE_S)
        self.settle("a")
        return self._itl(b.decode_latency(decode_prompt("load"), traffic, **kwargs), "load", key)

    def _store_window(self, size_mib: int, role: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """B decodes while computing a fresh prefix, until vLLM counts its bytes stored."""
        key, traffic = prompt_key(size_mib, role), prefix_prompt(self.plan, size_mib, role)
        store_bytes = self.plan.prefix_tokens(size_mib) // CHUNK_TOKENS * self.stride_bytes
        until = {"name": TIER_WRITE_BYTES, "labels": {"tier": self.tier_label},
                 "at_least": store_bytes}
        self.settle("a")
        store = self.b.decode_latency(decode_prompt("store"), traffic, **kwargs,
                                      until_counter=until,
                                      timeout_s=_STORE_DEADLINE_S + store_bound_s(store_bytes))
        out = self._itl(store, "store", key)
        out["stored_in_window_bytes"] = store["counter_growth"]
        out["stored_in_window"] = store["window_end"] == "stored"
        traffic_times = store.get("traffic") or {}
        out["stored_after_first_token_s"] = (
            None if store["counter_reached_at_s"] is None or "finished_at_s" not in traffic_times
            else store["counter_reached_at_s"] - traffic_times["finished_at_s"])
        return out

    def _itl_pooled(self, replies: list[Mapping[str, Any]]) -> dict[str, Any]:
        for reply in replies:
            self._check_decode("quiet", reply)
        out = itl_stats([iv for r in replies for iv in itl_window(r)])
        out["runs"] = [itl_stats(itl_window(r)) for r in replies]
        out["compute_interval_ms"] = None
        return out

    def _check_decode(self, what: str, reply: Mapping[str, Any]) -> None:
        dkey = f"decode/{what}"
        if dkey in self.expected:
            self._check(f"itl {what} decoding request", dkey, {"token_ids":
                        reply["decode_token_ids"][:len(self.expected[dkey])]})

    def _itl(self, reply: Mapping[str, Any], what: str, key: str | None = None) -> dict[str, Any]:
        skip = reply["compute_interval_index"]
        window = itl_window(reply)
        self._check_decode(what, reply)
        out = itl_stats(window, with_intervals=True)
        out["compute_interval_ms"] = reply["intervals_s"][skip] * 1e3 if skip is not None else None
        out["window_end"] = reply["window_end"]
        traffic = reply.get("traffic")
        if traffic is not None and key is not None:
            out["traffic_num_cached_tokens"] = traffic["num_cached_tokens"]
            out["traffic_seconds"] = traffic["finished_at_s"] - traffic["added_at_s"]
            out["traffic_match"] = self._check(f"itl {what} prompt", key, traffic)
        return out


def _ttfts(hit: Mapping[str, Any]) -> str:
    """A median hit's TTFT and, in brackets, each run's."""
    runs = "/".join(f"{t:.3f}" for t in hit["ttft_runs_s"])
    return f"{hit['ttft_s']:.3f} s [{runs}]"


def _p99s(windows: list[dict[str, Any]]) -> str:
    return "/".join(_fmt(w["p99_ms"]) for w in windows)


def _ends(windows: list[dict[str, Any]]) -> str:
    return ", ".join(sorted({w["window_end"] for w in windows}))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _fmt_ms(v: float | None) -> str:
    return "missing" if v is None else f"{v:.0f} ms"


def _fmt_s(v: float | None) -> str:
    return "missing" if v is None else f"{v:.3f} s"

