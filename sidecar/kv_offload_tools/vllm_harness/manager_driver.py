"""JSON-lines driver around vLLM's own scheduler-side ``TieringOffloadingManager``.

Run with vLLM's python, as a script (not ``-m``), so that the only
``kv_offload_sidecar`` it can import is the copy ``kv-offload install-tier``
put on ``PYTHONPATH`` (as in production)::

    PYTHONPATH=<vllm-0.33.0 or vllm-0.34.0 sources>:<install-tier DEST> PYTHONHASHSEED=0 \\
        python manager_driver.py --spec-json '{...}'

The manager is built the way vLLM builds it: the release's frozen
``OffloadingConfig`` structs (from the sidecar's config JSON plus this engine's
``engine_id`` and ``kv_connector_extra_config``), then
``TieringOffloadingSpec(config).get_manager()``, which creates the shared
primary region and every ``secondary_tiers`` entry through vLLM's
``SecondaryTierFactory``. Every manager call but ``shutdown`` holds
``manager.lock``, as vLLM's scheduler does; each scheduler step is the step's
lookups followed by ``on_schedule_end(ScheduleEndContext(...))``.

``--spec-json`` (an object, or ``@path`` to a file holding one)::

    {"offloading_config": {...},      # kv-offload's OffloadingConfig.to_dict()
     "engine_id": "mgr-a-1234",       # names /dev/shm/vllm_offload_<engine_id>.mmap
     "cpu_bytes_to_use": 1048576,
     "secondary_tiers": [{"type": "KVOffloadSecondaryTier",
                          "module_path": "kv_offload_sidecar.engine.vllm_tier", ...}],
     "extra_config": {...},           # optional, more kv_connector_extra_config keys
     # a tier entry's "model_identity" (a ModelIdentity dict) is what this stand-in engine
     # states (no VllmConfig builds the tier here to read one from)
     "init_none_hash": "after"}       # "after" (default) | "before" | "never"

``init_none_hash``: a vLLM engine core builds its scheduler (hence this
manager and its tiers) *before* it calls ``init_none_hash(sha256)``; "after"
keeps that order, "before" resolves vLLM's prefix-hash seed first, "never"
leaves it unresolved. The ready line reports the seed vLLM gives before
(``seed_before_init``) and after (``seed_resolved``).

Protocol: one JSON object per line on stdin, one JSON reply per line on
stdout (vLLM's and the tier's logs go to stderr; see ``driver_protocol``). The
first line written is the ready line (``{"ready": true, ...}`` or
``{"ready": false, "error": ...}``). Replies carry ``"ok": true`` or
``"error"`` and ``"traceback"``. Keys are hex strings of vLLM ``OffloadKey``s
(``make_offload_key(block_hash, group)``).

Ops: ping, keys, store, lookup, end_step, load, finish, reset_cache, stats,
take_events, tier_state, sidecar_instance, shutdown, exit (see the ``op_*`` methods).
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Running as a script puts this folder first on sys.path; drop it so nothing
# of kv_offload_tools (or a sibling module name) shadows what vLLM imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == _HERE:
    del sys.path[0]

# driver_protocol is the one module of this folder the driver uses; it is loaded
# by path so that the folder stays off sys.path.
_spec = importlib.util.spec_from_file_location("driver_protocol",
                                               os.path.join(_HERE, "driver_protocol.py"))
assert _spec is not None and _spec.loader is not None
driver_protocol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver_protocol)

# The protocol owns the real stdout; anything else printing (vLLM's logger
# defaults to stdout) lands on stderr.
_PROTOCOL = driver_protocol.ProtocolStdout(json_default=str)
_reply = _PROTOCOL.reply
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402


def _tier_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A secondary_tiers entry as vLLM's factory gets it; its "model_identity" dict becomes the
    ModelIdentity the tier states (the tier takes it as a constructor argument)."""
    out = dict(entry)
    if isinstance(out.get("model_identity"), Mapping):
        from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
        out["model_identity"] = ModelIdentity.from_dict(out["model_identity"])
    return out

logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("manager_driver")

# Seconds between scheduler steps while a lookup or cascade is pending (an
# engine with nothing else to do steps about this often).
DEFAULT_STEP_INTERVAL_S = 0.002
# Seconds between two probes of op_sidecar_instance while it waits for an instance
# (each probe is one lookup the tier sends its sidecar).
PROBE_INTERVAL_S = 0.02


def chunk_bytes_for(key: bytes, n: int) -> bytes:
    """The deterministic payload of chunk ``key``: sha256(key || i) blocks, ``n`` bytes."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(key + i.to_bytes(4, "big")).digest()
        i += 1
    return bytes(out[:n])


def _digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _transfers(tier: Any) -> dict[str, int] | None:
    """The tier's transfer jobs not finished yet: ``pending`` (submitted, not finished) and
    ``started`` (taken up by its transfer thread, e.g. a load waiting on a stalled sidecar),
    from the tier's ``transfers_in_flight``; None for a tier without it."""
    counts = getattr(tier, "transfers_in_flight", None)
    if counts is None:
        return None
    pending, started = counts
    return {"pending": int(pending), "started": int(started)}


def _detector_state(detector: Any) -> dict[str, Any] | None:
    """The back-pressure detector vLLM built for a tier: its class and the store
    completions it has been fed (vLLM feeds it each finished store job)."""
    if detector is None:
        return None
    return {"class": type(detector).__name__,
            "completions": getattr(detector, "_completions", None),
            "under_pressure": bool(detector.is_under_pressure())}


class _Recorder:
    """Wraps one tier instance's submit_load/submit_store/get_finished_jobs to
    count what vLLM's manager asks of it (observation only; calls go through)."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.lock = threading.Lock()
        self.promotions: list[dict[str, Any]] = []  # submit_load calls
        self.cascades: list[dict[str, Any]] = []  # submit_store calls
        self.results: dict[int, dict[str, Any]] = {}  # job_id -> result
        self._kind: dict[int, str] = {}
        orig_load, orig_store, orig_finished = tier.submit_load, tier.submit_store, \
            tier.get_finished_jobs

        def submit_load(job: Any) -> None:
            self._note(self.promotions, "promotion", job)
            return orig_load(job)

        def submit_store(job: Any) -> None:
            self._note(self.cascades, "cascade", job)
            return orig_store(job)

        def get_finished_jobs() -> Any:
            out = list(orig_finished())
            now = time.monotonic()
            for r in out:
                rec = {"job_id": int(r.job_id), "kind": self._kind.get(int(r.job_id)),
                       "success": bool(r.success),
                       "successful_keys": None if r.successful_keys is None
                       else len(r.successful_keys),
                       "transfer_time": r.transfer_time, "transfer_bytes": r.transfer_bytes,
                       "deferred_release": getattr(r, "deferred_release", None) is not None,
                       "reported_at": now}
                with self.lock:
                    self.results[int(r.job_id)] = rec
            return out

        tier.submit_load = submit_load
        tier.submit_store = submit_store
        tier.get_finished_jobs = get_finished_jobs

    def _note(self, into: list[dict[str, Any]], kind: str, job: Any) -> None:
        with self.lock:
            self._kind[int(job.job_id)] = kind
            into.append({"job_id": int(job.job_id), "keys": [bytes(k).hex() for k in job.keys],
                         "chunk_ids": [int(c) for c in job.chunk_ids],
                         "req_id": job.req_context.req_id, "submitted_at": time.monotonic()})

    def summary(self) -> dict[str, Any]:
        with self.lock:
            def jobs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
                return [{**j, "result": self.results.get(j["job_id"])} for j in items]
            return {"promotions": jobs(self.promotions), "cascades": jobs(self.cascades)}


class Driver:
    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.t_import0 = time.monotonic()
        import vllm
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.base import (
            ReqContext,
            ScheduleEndContext,
            make_offload_key,
        )
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
        self.import_s = time.monotonic() - self.t_import0

        self.ReqContext = ReqContext
        self.ScheduleEndContext = ScheduleEndContext
        self.make_offload_key = make_offload_key
        self.step_interval = float(spec.get("step_interval_s", DEFAULT_STEP_INTERVAL_S))

        oc = spec["offloading_config"]
        extra = dict(spec.get("extra_config") or {})
        extra["cpu_bytes_to_use"] = int(spec["cpu_bytes_to_use"])
        extra["secondary_tiers"] = [_tier_entry(t) for t in spec.get("secondary_tiers", [])]
        p = oc["parallel"]
        config = OffloadingConfig(
            groups=tuple(OffloadingGroupConfig(tokens_per_block=int(g["tokens_per_block"]),
                                               layer_names=tuple(g["layer_names"]),
                                               group_id=int(g["group_id"]))
                         for g in oc["groups"]),
            worker_kv_bytes_per_block=int(oc["worker_kv_bytes_per_block"]),
            enable_kv_cache_events=bool(oc.get("enable_kv_cache_events", False)),
            extra_config=extra,
            engine_id=str(spec["engine_id"]),
            model=OffloadingModelConfig(name=oc["model"]["name"], dtype=oc["model"]["dtype"]),
            cache=OffloadingCacheConfig(tokens_per_hash=int(oc["cache"]["tokens_per_hash"]),
                                        blocks_per_chunk=int(oc["cache"]["blocks_per_chunk"])),
            parallel=OffloadingParallelConfig(
                rank=int(p["rank"]), world_size=int(p["world_size"]), tp_size=int(p["tp_size"]),
                pp_size=int(p["pp_size"]), pcp_size=int(p["pcp_size"]),
                dcp_size=int(p["dcp_size"]), data_parallel_index=int(p["data_parallel_index"]),
                data_parallel_size=int(p["data_parallel_size"]),
                data_parallel_rank_local=p.get("data_parallel_rank_local"),
                is_parallelism_agnostic=bool(p["is_parallelism_agnostic"])),
            replicated_layout=bool(oc.get("replicated_layout", False)),
            canonical_layout=bool(oc.get("canonical_layout", False)),
            kv_cache_layout=oc.get("kv_cache_layout"),
        )
        self.config = config

        order = spec.get("init_none_hash", "after")
        if order not in ("before", "after", "never"):
            raise ValueError(f"init_none_hash must be before/after/never, got {order!r}")
        hash_fn = get_hash_fn_by_name(spec.get("prefix_caching_hash_algo", "sha256"))
        self.seed_unset = kv_cache_utils.get_none_hash_seed()
        if order == "before":
            kv_cache_utils.init_none_hash(hash_fn)

        t0 = time.monotonic()
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.build_s = time.monotonic() - t0
        assert isinstance(self.manager, TieringOffloadingManager), type(self.manager)
        if order == "after":
            kv_cache_utils.init_none_hash(hash_fn)
        self.seed_resolved = kv_cache_utils.get_none_hash_seed()

        self.region = self.spec._scheduler_mmap
        self.primary = self.manager.primary_tier
        view = self.primary.get_kv_memoryview()
        self.row_stride = int(view.strides[0])
        self.num_chunks = int(view.shape[0])
        self.chunk_bytes = int(config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk
                               * (1 if config.replicated_layout else config.parallel.world_size))
        self.tiers = list(self.manager.secondary_tiers)
        self.recorders = [_Recorder(t) for t in self.tiers]
        self.requests: dict[str, Any] = {}
        self.stats_total: Any = None
        self.vllm_file = vllm.__file__
        self.shut_down = False

    # ---- helpers -------------------------------------------------------------

    def key(self, name: str, group: int = 0) -> bytes:
        return bytes(self.make_offload_key(hashlib.sha256(name.encode()).digest(), group))

    def ctx(self, req_id: str, create: bool = True) -> Any:
        ctx = self.requests.get(req_id)
        if ctx is None:
            if not create:
                raise KeyError(f"unknown request {req_id!r}")
            ctx = self.ReqContext(req_id=req_id)
            self.requests[req_id] = ctx
            with self.manager.lock:
                self.manager.on_new_request(ctx)
        return ctx

    def end_step(self, new_req_ids: Sequence[str] = ()) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(self.ScheduleEndContext(
                new_req_ids=tuple(new_req_ids), preempted_req_ids=()))

    def _row_view(self, row: int) -> memoryview:
        """A 1-D byte view of primary row ``row`` (release it: vLLM closes the region
        only when no view of it is left)."""
        view = self.primary.get_kv_memoryview()
        flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view[:]
        try:
            return flat[row * self.row_stride:(row + 1) * self.row_stride]
        finally:
            flat.release()

    def write_row(self, row: int, data: bytes) -> None:
        with self._row_view(row) as sub:
            sub[:len(data)] = data

    def read_row(self, row: int, n: int | None = None) -> bytes:
        with self._row_view(row) as sub:
            return bytes(sub[:self.chunk_bytes if n is None else n])

    def tier_stats(self) -> list[dict[str, Any]]:
        out = []
        for t in self.tiers:
            s = getattr(t, "stats", None)
            if s is None:
                out.append({})
                continue
            d = {k: getattr(s, k) for k in ("lookups", "local_hits", "peer_hits", "misses",
                                            "lookup_timeouts", "bytes_loaded", "bytes_stored",
                                            "failed_loads", "failed_stores", "refused")}
            d["load_seconds"] = list(getattr(s, "load_seconds", ()))[-20:]
            out.append(d)
        return out

    def promotions_count(self) -> int:
        return sum(len(r.promotions) for r in self.recorders)

    # ---- ops -----------------------------------------------------------------

    def op_ping(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def op_keys(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """OffloadKeys for names: ``{"names": [...], "group": 0}``."""
        return {"keys": [self.key(n, int(cmd.get("group", 0))).hex() for n in cmd["names"]]}

    def op_store(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """Store chunks as the GPU->CPU path does, then step until their cascades finish.

        ``{"keys": [hex], "req_id": str, "timeout_s": 60, "finish": true}``:
        prepare_store, write each chunk's deterministic bytes into its primary
        row through the manager's memoryview, complete_store (which cascades to
        every secondary tier), then on_schedule_end steps until no job of the
        manager is left (``timeout_s`` guards against a hang; ``jobs_left`` says
        what was still unfinished). Reports rows, row digests and the cascade results.
        """
        keys = [bytes.fromhex(k) for k in cmd["keys"]]
        req_id = str(cmd.get("req_id") or f"store-{time.monotonic_ns()}")
        timeout = float(cmd.get("timeout_s", 60.0))
        ctx = self.ctx(req_id)
        before = [len(r.cascades) for r in self.recorders]
        t0 = time.monotonic()
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        if out is None:
            return {"stored": 0, "prepared": None, "elapsed_s": time.monotonic() - t0}
        rows = [int(c) for c in out.store_spec.chunk_ids]
        to_store = [bytes(k) for k in out.keys_to_store]
        digests = {}
        for key, row in zip(to_store, rows):
            data = chunk_bytes_for(key, self.chunk_bytes)
            self.write_row(row, data)
            digests[key.hex()] = _digest(self.read_row(row))
        with self.manager.lock:
            if to_store:
                self.manager.complete_store(out.keys_to_store, ctx, True)
        steps = 0
        deadline = t0 + timeout
        while True:
            self.end_step()
            steps += 1
            with self.manager.lock:
                pending = bool(self.manager._jobs)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(self.step_interval)
        elapsed = time.monotonic() - t0
        if cmd.get("finish", True):
            self._finish(req_id)
        cascades = []
        for r, n in zip(self.recorders, before):
            s = r.summary()["cascades"][n:]
            cascades.append([{"job_id": j["job_id"], "n_keys": len(j["keys"]),
                              "result": j["result"]} for j in s])
        return {"stored": len(to_store), "rows": rows, "keys": [k.hex() for k in to_store],
                "evicted": len(out.evicted_keys), "digests": digests, "cascades": cascades,
                "jobs_left": len(self.manager._jobs), "steps": steps, "elapsed_s": elapsed}

    def op_lookup(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """Look keys up as vLLM's scheduler does, one step after another.

        ``{"keys": [hex], "req_id": str, "max_s": 10, "stop_at": null|"hit_pending",
        "resume": false}``. A step looks the keys up in order (HIT and
        HIT_PENDING count, RETRY keeps scanning, MISS stops) and ends with
        on_schedule_end; steps repeat while a key was RETRY or HIT_PENDING,
        until ``max_s``. The step that resolves the request names it in
        ``new_req_ids`` (the scheduler schedules it then). With ``stop_at`` set
        to "hit_pending" the first step that has a HIT_PENDING returns before
        its on_schedule_end (so the promotion is not yet submitted);
        ``resume`` starts with that pending on_schedule_end.

        Reply: ``final`` (results of the last step, MISS-truncated like the
        scheduler), ``steps`` (runs of identical step results:
        ``[[results...], count]``), ``hits`` (leading HIT count), ``paused``,
        ``promotions`` (submit_load calls during this op), ``elapsed_s``.
        """
        keys = [bytes.fromhex(k) for k in cmd["keys"]]
        req_id = str(cmd["req_id"])
        max_s = float(cmd.get("max_s", 10.0))
        stop_at = cmd.get("stop_at")
        ctx = self.ctx(req_id)
        prom_before = self.promotions_count()
        t0 = time.monotonic()
        runs: list[list[Any]] = []
        first_at: dict[str, float] = {}
        if cmd.get("resume"):
            self.end_step()
        results: list[str] = []
        paused = False
        timed_out = False
        while True:
            results = []
            with self.manager.lock:
                for key in keys:
                    r = self.manager.lookup(key, ctx).name
                    results.append(r)
                    if r == "MISS":
                        break
            now = time.monotonic()
            for r in set(results):
                first_at.setdefault(r, now - t0)
            if runs and runs[-1][0] == results:
                runs[-1][1] += 1
            else:
                runs.append([list(results), 1])
            deferred = any(r in ("RETRY", "HIT_PENDING") for r in results)
            if stop_at == "hit_pending" and "HIT_PENDING" in results:
                paused = True
                break
            if not deferred:
                self.end_step(new_req_ids=(req_id,))
                break
            self.end_step()
            if now - t0 > max_s:
                timed_out = True
                break
            time.sleep(self.step_interval)
        elapsed = time.monotonic() - t0
        hits = 0
        for r in results:
            if r != "HIT":
                break
            hits += 1
        return {"final": results, "hits": hits, "steps": runs,
                "n_steps": sum(n for _, n in runs), "paused": paused, "timed_out": timed_out,
                "first_seen_s": first_at,
                "promotions": self.promotions_count() - prom_before,
                "promotions_total": self.promotions_count(), "elapsed_s": elapsed}

    def op_end_step(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """One on_schedule_end (``{"new_req_ids": [...]}`` optional)."""
        t0 = time.monotonic()
        self.end_step(cmd.get("new_req_ids") or ())
        return {"elapsed_s": time.monotonic() - t0, "promotions_total": self.promotions_count()}

    def op_load(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """prepare_load keys a lookup answered HIT, compare their primary rows with the
        deterministic bytes, report get_load_source, then complete_load.

        ``{"keys": [hex], "req_id": str}`` (the request must still be live for
        get_load_source to know where a promoted chunk came from).
        """
        keys = [bytes.fromhex(k) for k in cmd["keys"]]
        ctx = self.ctx(str(cmd["req_id"]), create=False)
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
            sources = [str(getattr(s, "value", s))
                       for s in (self.manager.get_load_source(k, ctx) for k in keys)]
        try:
            rows = [int(c) for c in spec.chunk_ids]
            match, digests = [], {}
            for key, row in zip(keys, rows):
                data = self.read_row(row)
                digests[key.hex()] = _digest(data)
                match.append(data == chunk_bytes_for(key, self.chunk_bytes))
        finally:
            with self.manager.lock:
                self.manager.complete_load(keys, ctx)
        return {"rows": rows, "match": match, "digests": digests, "sources": sources}

    def _finish(self, req_id: str) -> None:
        ctx = self.requests.pop(req_id, None)
        if ctx is None:
            return
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        self.end_step()

    def op_finish(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """on_request_finished for ``req_id`` (then one on_schedule_end)."""
        self._finish(str(cmd["req_id"]))
        return {"live_requests": sorted(self.requests)}

    def op_reset_cache(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """manager.reset_cache() under the lock, timed; then (``flush``, default true)
        on_reset_flushed() as the scheduler does once workers report the reset's jobs."""
        jobs_before = len(self.manager._jobs)
        t0 = time.monotonic()
        error = tb = None
        try:
            with self.manager.lock:
                self.manager.reset_cache()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            error, tb = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        elapsed = time.monotonic() - t0
        if error is None and cmd.get("flush", True):
            with self.manager.lock:
                self.manager.on_reset_flushed()
        return {"elapsed_s": elapsed, "reset_error": error, "reset_traceback": tb,
                "jobs_before": jobs_before, "jobs_after": len(self.manager._jobs)}

    def _stats_dict(self) -> dict[str, Any]:
        total = self.stats_total
        if total is None:
            return {}
        types, values = total.metric_sections()
        out: dict[str, Any] = {}
        for name, series in values.items():
            kind = types.get(name)
            entries = []
            for labels, value in series.items():
                e: dict[str, Any] = {"labels": list(labels)}
                if isinstance(value, list):
                    e.update(count=len(value), sum=float(sum(value)))
                else:
                    e["value"] = value
                entries.append(e)
            out[name] = {"type": kind, "series": entries}
        return out

    def op_stats(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """manager.get_stats() accumulated since start (as vLLM's logger aggregates),
        the tiers' own counters, and the recorded promotion/cascade jobs."""
        with self.manager.lock:
            stats = self.manager.get_stats()
        if stats is not None and not stats.is_empty():
            if self.stats_total is None:
                from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                    OffloadingConnectorStats,
                )
                self.stats_total = OffloadingConnectorStats()
            self.stats_total.aggregate(stats)
        return {"vllm": self._stats_dict(), "tiers": self.tier_stats(),
                "tier_labels": [f"{i + 1}:{t.tier_type}" for i, t in enumerate(self.tiers)],
                "jobs": [r.summary() for r in self.recorders],
                "manager_jobs": len(self.manager._jobs), "deferred": self._deferred()}

    def _deferred(self) -> dict[str, Any]:
        """Failed promotions whose rows vLLM holds until their tier's event: ``jobs``, their
        ``rows`` and the primary tier's count (None where the release has no deferred
        release, before 0.34), and ``free_rows``, the released rows vLLM may reuse now."""
        held = getattr(self.manager, "_deferred_releases", None)
        return {"jobs": None if held is None else len(held),
                "rows": None if held is None else
                sorted(int(c) for d in held.values() for c in d.chunk_ids),
                "primary_chunks": getattr(self.primary, "num_deferred_release_chunks", None),
                "free_rows": sorted(int(c) for c in self.primary._free_list)}

    def op_take_events(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        with self.manager.lock:
            events = list(self.manager.take_events())
        return {"events": [{"n_keys": len(e.keys), "keys": [bytes(k).hex() for k in e.keys],
                            "medium": getattr(e.medium, "value", str(e.medium)),
                            "removed": bool(e.removed),
                            "locality": None if e.locality is None
                            else getattr(e.locality, "value", str(e.locality)),
                            "ownership": e.ownership} for e in events]}

    def op_tier_state(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """The tiers' counters, connection state and whether they have pending work."""
        out = []
        with self.manager.lock:
            for t in self.tiers:
                out.append({"type": t.tier_type, "class": type(t).__name__,
                            "module_file": sys.modules[type(t).__module__].__file__,
                            "address": list(getattr(t, "address", ()) or ()),
                            "engine_hash_seed": getattr(t, "engine_hash_seed", None),
                            "has_pending_work": bool(t.has_pending_work()),
                            "cache_hit_source": str(getattr(t.cache_hit_source, "value",
                                                            t.cache_hit_source)),
                            "locality": None if t.locality is None
                            else getattr(t.locality, "value", str(t.locality)),
                            "backpressure": _detector_state(t.bp_detector),
                            "transfers": _transfers(t)})
        return {"tiers": out, "stats": self.tier_stats()}

    def _probe(self, deadline: float) -> list[str]:
        """One lookup through every tier of a key nobody stores, under a request of the
        probe's own, stepped until each tier answered (HIT or MISS; a tier answers MISS
        past its lookup deadline), then finished. vLLM's manager is not involved (its jobs
        and stats stay as they were); each tier counts one lookup."""
        name = f"kv-offload-harness-probe-{time.monotonic_ns()}"
        ctx = self.ReqContext(req_id=name)
        key = self.key(name)
        end = self.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        answers: list[str] = ["RETRY"] * len(self.tiers)
        with self.manager.lock:
            for t in self.tiers:
                t.on_new_request(ctx)
        try:
            while True:
                with self.manager.lock:
                    for i, t in enumerate(self.tiers):
                        if answers[i] == "RETRY":
                            answers[i] = t.lookup(key, ctx).name
                    for t in self.tiers:
                        t.on_schedule_end(end)
                if "RETRY" not in answers or time.monotonic() > deadline:
                    return answers
                time.sleep(self.step_interval)
        finally:
            with self.manager.lock:
                for t in self.tiers:
                    t.on_request_finished(ctx)

    def op_sidecar_instance(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """The sidecar instance each tier is attached to (``sidecar_instance``), after a
        harmless lookup through it (a tier notices a restarted sidecar at its next operation).

        ``{"tier": 0, "wait_for": null|str, "timeout_s": 60}``: with ``wait_for``, probe
        every ``PROBE_INTERVAL_S`` until tier ``tier`` names that instance or ``timeout_s``
        passed (``matched`` says which). Reply: ``instances`` (one per tier; None: not
        attached, or refused), ``matched``, ``probes``, ``answers`` (the last probe's
        lookup results), ``refused`` (each tier's refusal, if any), ``elapsed_s``.
        """
        index = int(cmd.get("tier", 0))
        want = cmd.get("wait_for")
        t0 = time.monotonic()
        deadline = t0 + float(cmd.get("timeout_s", 60.0))
        missing = [type(t).__name__ for t in self.tiers if not hasattr(t, "sidecar_instance")]
        if missing:
            raise AttributeError(f"tier(s) {missing} expose no sidecar_instance")
        probes = 0
        while True:
            answers = self._probe(deadline)
            probes += 1
            instances = [t.sidecar_instance for t in self.tiers]
            matched = want is None or instances[index] == want
            if matched or time.monotonic() > deadline:
                break
            time.sleep(PROBE_INTERVAL_S)
        return {"instances": instances, "matched": matched, "probes": probes,
                "answers": answers, "refused": [s.get("refused") for s in self.tier_stats()],
                "elapsed_s": time.monotonic() - t0}

    def op_shutdown(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """manager.shutdown() WITHOUT the lock (as vLLM calls it); then check that vLLM
        closed its primary region: mmap closed, fd closed, file unlinked, view released."""
        for req_id in list(self.requests):
            self._finish(req_id)
        region = self.region
        path = getattr(region, "mmap_path", None)
        existed = bool(path) and os.path.exists(path)
        t0 = time.monotonic()
        error = tb = None
        try:
            self.manager.shutdown()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            error, tb = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        elapsed = time.monotonic() - t0
        self.shut_down = True
        view = self.primary._kv_memoryview
        try:
            len(view)
            view_released = False
        except ValueError:
            view_released = True
        tier_rows_released = [getattr(t, "_rows", None) is None for t in self.tiers]
        threads = sorted(th.name for th in threading.enumerate()
                         if th is not threading.main_thread() and th.is_alive())
        return {"shutdown_error": error, "shutdown_traceback": tb, "elapsed_s": elapsed,
                "mmap_path": path, "file_existed": existed,
                "file_exists": bool(path) and os.path.exists(path),
                "mmap_closed": getattr(region, "mmap_obj", "?") is None,
                "fd_closed": getattr(region, "fd", "?") is None,
                "primary_view_released": view_released,
                "tier_rows_released": tier_rows_released, "threads": threads}


def _load_spec(raw: str) -> dict[str, Any]:
    if raw.startswith("@"):
        with open(raw[1:], encoding="utf-8") as fh:
            return json.load(fh)
    return json.loads(raw)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-json", required=True,
                    help="driver spec as a JSON object, or @path of a file holding one")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        spec = _load_spec(args.spec_json)
        drv = Driver(spec)
    except BaseException as exc:  # noqa: BLE001
        _reply({"ready": False, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()})
        return 1
    tiers = drv.op_tier_state({})["tiers"]
    _reply({"ready": True, "pid": os.getpid(), "engine_id": drv.config.engine_id,
            "start_s": time.monotonic() - t0, "import_s": drv.import_s, "build_s": drv.build_s,
            "vllm_file": drv.vllm_file, "mmap_path": getattr(drv.region, "mmap_path", None),
            "num_chunks": drv.num_chunks, "row_stride": drv.row_stride,
            "chunk_bytes": drv.chunk_bytes, "seed_before_init": drv.seed_unset,
            "seed_resolved": drv.seed_resolved, "tiers": tiers,
            "python_hash_seed": os.environ.get("PYTHONHASHSEED")})
    ops: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
        name[3:]: getattr(drv, name) for name in dir(drv) if name.startswith("op_")}
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd: Any = None
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "exit":
                if not drv.shut_down:
                    res = drv.op_shutdown({})
                    _reply({"ok": True, "op": "exit", "shutdown": res})
                else:
                    _reply({"ok": True, "op": "exit"})
                break
            fn = ops.get(op)
            if fn is None:
                raise ValueError(f"unknown op {op!r}; ops: {sorted(ops) + ['exit']}")
            res = fn(cmd)
            _reply({"ok": True, "op": op, **res})
        except BaseException as exc:  # noqa: BLE001 - the driver keeps serving
            _reply({"ok": False, "op": cmd.get("op") if isinstance(cmd, dict) else None,
                    "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    if not drv.shut_down:  # stdin closed without "exit" (the client died): still clean up
        try:
            drv.op_shutdown({})
        except BaseException:  # noqa: BLE001
            log.exception("manager shutdown at end of input failed")
    _PROTOCOL.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
