"""kv-offload as a vLLM secondary tier: offloaded chunks flow through the pod's sidecar.

vLLM's ``TieringOffloadingSpec`` keeps offloaded chunks in a CPU primary tier
(one shared-memory row per chunk) and cascades them to secondary tiers. This
module is such a tier, loaded from ``module_path``: stores copy rows into the
sidecar's shared-memory slots, loads copy slots back into rows (the sidecar
first fetches chunks it does not hold from a peer pod), and lookups ask the
sidecar which chunks the pool holds. vLLM resolves an out-of-tree tier class
as ``getattr(import_module(module_path), type)``, so ``type`` is the class name.

Add to ``vllm serve`` (``cpu_bytes_to_use`` is the primary tier's size)::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
        "cpu_bytes_to_use":8589934592,"block_size":64,
        "secondary_tiers":[{"type":"KVOffloadSecondaryTier",
                            "module_path":"kv_offload_sidecar.vllm_tier"}]}}'

Optional tier keys: ``host`` and ``port`` (the sidecar's control host and base
port; default ``VLLM_P2P_SIDE_CHANNEL_HOST`` / ``VLLM_P2P_SIDE_CHANNEL_PORT``,
i.e. ``localhost:5710``; this engine's global data-parallel index is added to
the port), ``lookup_timeout_seconds`` (a lookup unanswered by then is a miss),
``load_timeout_seconds`` (a load not finished by then fails; vLLM recomputes).
Set ``PYTHONHASHSEED`` to the pool's hash seed so every pod hashes prefixes alike; the
tier logs an error (and ``stats.hash_seed_problem`` says why) when it differs from the
seed the sidecar states to its peers, or is unset.

Threading: every SecondaryTierManager method runs on vLLM's scheduler thread
and returns at once. Lookups are batched per scheduler step (flushed in
``on_schedule_end``) and answered by a lookup thread; transfers run on a
transfer thread; results come back through queues drained by the scheduler
thread. Imports: the standard library, numpy, this package's ``client``, and
vLLM's own classes when vLLM is importable (stand-ins with the same names and
fields otherwise, for tests and the simulated engine).
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:  # vLLM's own contract when running inside vLLM.
    import vllm.v1.kv_offload.base as _vbase  # type: ignore[import-not-found]
    import vllm.v1.kv_offload.tiering.base as _vtier  # type: ignore[import-not-found]

    def _vllm(name: str, *alternatives: str) -> Any:
        """A vLLM class from the tiering or the core module (it moved between releases)."""
        for mod in (_vtier, _vbase):
            for n in (name, *alternatives):
                if hasattr(mod, n):
                    return getattr(mod, n)
        raise ImportError(f"vLLM has no {name}")

    SecondaryTierManager = _vllm("SecondaryTierManager")
    JobResult = _vllm("JobResult")
    TransferJob = _vllm("TransferJob", "JobMetadata")  # JobMetadata before the rename
    LookupResult = _vllm("LookupResult")
    ReqContext = _vllm("ReqContext")
    RequestOffloadingContext = _vllm("RequestOffloadingContext")
    VLLM_AVAILABLE = True
except ImportError:
    VLLM_AVAILABLE = False

    class LookupResult(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's LookupResult."""

        MISS = enum.auto()
        HIT = enum.auto()
        HIT_PENDING = enum.auto()
        RETRY = enum.auto()

    class OffloadPolicy(enum.Enum):
        """Stand-in for vLLM's OffloadPolicy."""

        CHUNK_LEVEL = "chunk_level"
        REQUEST_LEVEL = "request_level"

    @dataclass
    class RequestOffloadingContext:  # type: ignore[no-redef]
        """Stand-in for vLLM's RequestOffloadingContext."""

        policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL

    @dataclass
    class ReqContext:  # type: ignore[no-redef]
        """Stand-in for vLLM's ReqContext."""

        req_id: str
        kv_transfer_params: dict[str, Any] | None = None

    @dataclass
    class TransferJob:  # type: ignore[no-redef]
        """Stand-in for vLLM's TransferJob: chunk_ids are primary-tier rows."""

        job_id: int
        keys: Collection[bytes]
        chunk_ids: np.ndarray
        is_promotion: bool
        req_context: ReqContext

    @dataclass
    class JobResult:  # type: ignore[no-redef]
        """Stand-in for vLLM's JobResult."""

        job_id: int
        success: bool

    class SecondaryTierManager(ABC):  # type: ignore[no-redef]
        """Stand-in for vLLM's SecondaryTierManager (same constructor)."""

        def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                     tier_type: str) -> None:
            self._offloading_spec = offloading_spec
            self._primary_kv_view = primary_kv_view
            self.tier_type = tier_type

        @abstractmethod
        def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

        @abstractmethod
        def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult: ...

        @abstractmethod
        def submit_store(self, job: TransferJob) -> None: ...

        @abstractmethod
        def submit_load(self, job: TransferJob) -> None: ...

        @abstractmethod
        def get_finished_jobs(self) -> Iterable[JobResult]: ...

        @abstractmethod
        def drain_jobs(self) -> None: ...

        def shutdown(self) -> None:
            return None

logger = logging.getLogger(__name__)

ENV_HOST = "VLLM_P2P_SIDE_CHANNEL_HOST"
ENV_PORT = "VLLM_P2P_SIDE_CHANNEL_PORT"
DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5710
# Tier-entry keys vLLM may pass to any tier; accepted and unused here.
_GENERIC_TIER_KEYS = frozenset({"enable_kv_events", "locality", "name"})
_STOP = object()


@dataclass
class TierStats:
    """Chunk-level counters of one tier, read by the simulated engine and the demo."""

    # Chunk keys whose lookup the sidecar answered.
    lookups: int = 0
    # Keys answered as present in this pod's sidecar store.
    local_hits: int = 0
    # Keys answered as present on a peer pod.
    peer_hits: int = 0
    # Keys answered as absent, or unanswered by the lookup deadline.
    misses: int = 0
    # Lookup batches that failed or ran past the deadline.
    lookup_timeouts: int = 0
    # Bytes copied from the sidecar into primary-tier rows.
    bytes_loaded: int = 0
    # Bytes copied from primary-tier rows into the sidecar.
    bytes_stored: int = 0
    # Load jobs that failed (vLLM recomputes those chunks).
    failed_loads: int = 0
    # Store jobs that failed (the chunks stay only in vLLM's primary tier).
    failed_stores: int = 0
    # Seconds from submit_load to its result, for the latest load jobs (bounded).
    load_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    # Why this engine's chunk keys cannot match its peers' (see hash_seed_problem), or None.
    hash_seed_problem: str | None = None


@dataclass
class _KeyState:
    submitted: float
    # None while unanswered, then True (present) or False (absent).
    result: bool | None = None
    request_ids: set[str] = field(default_factory=set)


def sidecar_address(offloading_spec: Any, host: str | None = None,
                    port: int | str | None = None,
                    environ: dict[str, str] | None = None) -> tuple[str, int]:
    """The pod sidecar's control address for this engine's DP rank.

    ``host``/``port`` from the tier entry win over ``VLLM_P2P_SIDE_CHANNEL_*``;
    the engine's global ``parallel.data_parallel_index`` is added to the port.
    """
    env = os.environ if environ is None else environ
    host = host or env.get(ENV_HOST) or DEFAULT_HOST
    raw = port if port is not None else env.get(ENV_PORT) or DEFAULT_PORT
    try:
        base = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"kv-offload tier: port {raw!r} is not an integer; set the tier's "
                         f"'port' or {ENV_PORT} to the sidecar's base control port") from None
    config = getattr(offloading_spec, "config", offloading_spec)
    dp_index = int(getattr(getattr(config, "parallel", None), "data_parallel_index", 0) or 0)
    if not 0 < base + dp_index <= 65535:
        raise ValueError(f"kv-offload tier: port {base} + DP index {dp_index} is not a valid "
                         f"port; set the tier's 'port' or {ENV_PORT}")
    return host, base + dp_index


def hash_seed_problem(engine_seed: str | None, sidecar_seed: str | None) -> str | None:
    """Why chunk keys this engine computes cannot match the pool's, or None.

    vLLM seeds its prefix hashes from ``PYTHONHASHSEED`` (at random when it is unset);
    the sidecar states the pool's hash seed to its peers. When the two differ, every
    key this engine offloads is unique to it: the pool stays correct (keys are hashes,
    nothing is confused) but this pod never gets a peer hit, silently. ``sidecar_seed``
    None (a sidecar that does not report it) is not a problem.
    """
    if sidecar_seed is None:
        return None
    if engine_seed is None:
        return (f"PYTHONHASHSEED is not set in this vLLM process, so vLLM seeds its prefix hashes "
                f"at random and no chunk it offloads can match another pod's; set "
                f"PYTHONHASHSEED={sidecar_seed} (the hash seed the sidecar states to its peers)")
    if engine_seed != sidecar_seed:
        return (f"PYTHONHASHSEED={engine_seed} in this vLLM process but the sidecar states hash seed "
                f"{sidecar_seed} to its peers, so this engine's chunk keys match none of theirs; set "
                f"PYTHONHASHSEED={sidecar_seed} here (or the sidecar's --hash-seed to {engine_seed})")
    return None


def chunk_bytes_of(offloading_spec: Any) -> int:
    """kv_bytes_per_chunk of vLLM's OffloadingConfig: bytes of one row's worker slots."""
    config = getattr(offloading_spec, "config", offloading_spec)
    workers = 1 if getattr(config, "replicated_layout", False) else config.parallel.world_size
    return int(config.worker_kv_bytes_per_block) * int(config.cache.blocks_per_chunk) * int(workers)


class KVOffloadSecondaryTier(SecondaryTierManager):
    """vLLM secondary tier backed by the pod's kv-offload sidecar."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                 tier_type: str = "KVOffloadSecondaryTier", host: str | None = None,
                 port: int | str | None = None, lookup_timeout_seconds: float = 0.5,
                 load_timeout_seconds: float = 5.0, client: Any = None,
                 **tier_kwargs: Any) -> None:
        unknown = sorted(set(tier_kwargs) - _GENERIC_TIER_KEYS)
        if unknown:
            raise ValueError(
                f"kv-offload tier: unknown key(s) {unknown} in the secondary_tiers entry; "
                "valid keys: host, port, lookup_timeout_seconds, load_timeout_seconds")
        for name, value in (("lookup_timeout_seconds", lookup_timeout_seconds),
                            ("load_timeout_seconds", load_timeout_seconds)):
            if not float(value) > 0:
                raise ValueError(f"kv-offload tier: {name} must be positive, got {value!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self._chunk_bytes = chunk_bytes_of(offloading_spec)
        flat = primary_kv_view.cast("B") if primary_kv_view.format != "B" or \
            primary_kv_view.ndim != 1 else primary_kv_view
        self._rows = flat
        self._row_stride = (primary_kv_view.strides[0] if primary_kv_view.ndim >= 2
                            else self._chunk_bytes)
        if self._row_stride < self._chunk_bytes:
            raise ValueError(
                f"kv-offload tier: primary rows are {self._row_stride} bytes but a chunk is "
                f"{self._chunk_bytes} bytes; the tier and vLLM disagree on the chunk geometry")
        self._lookup_timeout = float(lookup_timeout_seconds)
        self._load_timeout = float(load_timeout_seconds)
        self.address = sidecar_address(offloading_spec, host, port)
        # The seed vLLM hashes prefixes with in this process (the simulated engine sets its own).
        self.engine_hash_seed: str | None = os.environ.get("PYTHONHASHSEED")
        # Connected lazily by the worker threads, so vLLM starts even before its sidecar.
        self._client = client
        self._client_lock = threading.Lock()
        self._next_connect = 0.0
        self.stats = TierStats()

        # Scheduler-thread state (no lock: only the scheduler thread touches it).
        self._keys: OrderedDict[bytes, _KeyState] = OrderedDict()
        self._req_keys: dict[str, set[bytes]] = {}
        self._batch: dict[str, list[bytes]] = {}
        self._in_flight = 0
        # Thread hand-offs.
        self._lookup_q: queue.SimpleQueue = queue.SimpleQueue()
        self._lookup_results: queue.SimpleQueue = queue.SimpleQueue()
        self._transfer_q: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending_transfers = 0
        self._stats_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._lookup_worker, name="kv-offload-lookup", daemon=True),
            threading.Thread(target=self._transfer_worker, name="kv-offload-transfer",
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- SecondaryTierManager: scheduler thread -----------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        """HIT / MISS once the sidecar answered; RETRY while asking; MISS past the deadline."""
        self._drain_lookup_results()
        key = bytes(key)
        state = self._keys.get(key)
        now = time.monotonic()
        if state is None:
            state = self._keys[key] = _KeyState(submitted=now)
            self._batch.setdefault(req_context.req_id, []).append(key)
        state.request_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if state.result is None:
            if now - state.submitted > self._lookup_timeout:
                state.result = False  # unanswered in time: vLLM recomputes
                with self._stats_lock:
                    self.stats.misses += 1
                return LookupResult.MISS
            return LookupResult.RETRY
        return LookupResult.HIT if state.result else LookupResult.MISS

    def on_schedule_end(self, context: Any = None) -> None:
        """Send this step's lookups to the lookup thread as one batch."""
        if self._batch:
            self._lookup_q.put((time.monotonic(), self._batch))
            self._batch = {}

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget lookup answers no live request needs (the pool changes over time)."""
        req_id = req_context.req_id
        self._batch.pop(req_id, None)
        for key in self._req_keys.pop(req_id, ()):
            state = self._keys.get(key)
            if state is None:
                continue
            state.request_ids.discard(req_id)
            if not state.request_ids:
                del self._keys[key]

    # vLLM releases before the on_request_finished rename call it request_finished.
    request_finished = on_request_finished

    def submit_store(self, job: TransferJob) -> None:
        self._submit("store", job)

    def submit_load(self, job: TransferJob) -> None:
        self._submit("load", job)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                job_id, ok = self._finished.get_nowait()
            except queue.Empty:
                return out
            self._in_flight -= 1
            out.append(JobResult(job_id=job_id, success=ok))

    # vLLM releases before the get_finished_jobs rename poll get_finished.
    get_finished = get_finished_jobs

    def drain_jobs(self, timeout: float | None = None) -> None:
        """Block until every submitted transfer has finished (bounded by the load timeout)."""
        deadline = time.monotonic() + (timeout if timeout is not None
                                       else self._load_timeout + 1.0)
        with self._idle:
            while self._pending_transfers and time.monotonic() < deadline:
                self._idle.wait(max(0.0, min(0.1, deadline - time.monotonic())))

    def has_pending_work(self) -> bool:
        return bool(self._in_flight or self._batch or any(
            s.result is None for s in self._keys.values()))

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        return None

    def shutdown(self) -> None:
        self.drain_jobs()
        self._lookup_q.put(_STOP)
        self._transfer_q.put(_STOP)
        for t in self._threads:
            t.join(timeout=self._load_timeout + 1.0)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    stop_executor = shutdown

    # ---- internals ------------------------------------------------------------

    def _submit(self, kind: str, job: TransferJob) -> None:
        rows = getattr(job, "chunk_ids", None)
        if rows is None:  # older vLLM: JobMetadata.block_ids
            rows = job.block_ids
        self._in_flight += 1
        with self._idle:
            self._pending_transfers += 1
        self._transfer_q.put((kind, job.job_id, [bytes(k) for k in job.keys],
                              [int(r) for r in rows], time.monotonic()))

    def _drain_lookup_results(self) -> None:
        while True:
            try:
                answers = self._lookup_results.get_nowait()
            except queue.Empty:
                return
            for key, present in answers:
                state = self._keys.get(key)
                if state is not None and state.result is None:
                    state.result = present

    def _row(self, row: int) -> memoryview:
        start = row * self._row_stride
        return self._rows[start:start + self._chunk_bytes]

    def _lookup_worker(self) -> None:
        while True:
            item = self._lookup_q.get()
            if item is _STOP:
                return
            submitted, batch = item
            for keys in batch.values():
                self._lookup_batch(keys, submitted)

    def _lookup_batch(self, keys: Sequence[bytes], submitted: float) -> None:
        remaining = self._lookup_timeout - (time.monotonic() - submitted)
        if remaining <= 0:
            with self._stats_lock:
                self.stats.lookup_timeouts += 1
            return  # the scheduler side already answers these keys MISS
        try:
            reply = self._connected().lookup(list(keys), timeout=remaining)
        except Exception as exc:  # sidecar down, slow or refusing: every key is a miss
            logger.warning("kv-offload lookup of %d keys failed: %s", len(keys), exc)
            with self._stats_lock:
                self.stats.lookup_timeouts += 1
            self._lookup_results.put([(k, False) for k in keys])
            return
        local, total = _hit_prefix(reply, len(keys))
        with self._stats_lock:
            self.stats.lookups += len(keys)
            self.stats.local_hits += local
            self.stats.peer_hits += total - local
            self.stats.misses += len(keys) - total
        self._lookup_results.put([(k, i < total) for i, k in enumerate(keys)])

    def _connected(self) -> Any:
        """The EngineClient, connecting at most once per second while the sidecar is away."""
        with self._client_lock:
            if self._client is None:
                if time.monotonic() < self._next_connect:
                    raise ConnectionError("kv-offload sidecar not reachable yet")
                from .client import EngineClient
                try:
                    self._client = EngineClient.connect(*self.address,
                                                        timeout=self._load_timeout)
                except Exception:
                    self._next_connect = time.monotonic() + 1.0
                    raise
                self._check_hash_seed(self._client.info())
            return self._client

    def _check_hash_seed(self, info: dict[str, Any]) -> None:
        """Say loudly, at each (re)connection, when this engine's keys cannot match the pool's."""
        problem = hash_seed_problem(self.engine_hash_seed, info.get("hash_seed"))
        with self._stats_lock:
            self.stats.hash_seed_problem = problem
        if problem is not None:
            logger.error("kv-offload tier: %s", problem)

    def _transfer_worker(self) -> None:
        while True:
            item = self._transfer_q.get()
            if item is _STOP:
                return
            kind, job_id, keys, rows, submitted = item
            try:
                ok = self._load(keys, rows) if kind == "load" else self._store(keys, rows)
            except Exception as exc:
                logger.warning("kv-offload %s job %d failed: %s", kind, job_id, exc)
                ok = False
            with self._stats_lock:
                if kind == "load":
                    self.stats.load_seconds.append(time.monotonic() - submitted)
                    self.stats.failed_loads += not ok
                else:
                    self.stats.failed_stores += not ok
            self._finished.put((job_id, ok))
            with self._idle:
                self._pending_transfers -= 1
                self._idle.notify_all()

    def _load(self, keys: list[bytes], rows: list[int]) -> bool:
        def read(i: int, slot: memoryview) -> None:
            self._row(rows[i])[:] = slot if slot.nbytes == self._chunk_bytes else \
                slot.cast("B")[:self._chunk_bytes]

        loaded = self._connected().load(keys, read, timeout=self._load_timeout)
        with self._stats_lock:
            self.stats.bytes_loaded += loaded * self._chunk_bytes
        return loaded == len(keys)

    def _store(self, keys: list[bytes], rows: list[int]) -> bool:
        def write(i: int, slot: memoryview) -> None:
            if slot.nbytes == self._chunk_bytes:
                slot[:] = self._row(rows[i])
            else:
                slot.cast("B")[:self._chunk_bytes] = self._row(rows[i])

        stored = self._connected().store(keys, write)
        with self._stats_lock:
            self.stats.bytes_stored += stored * self._chunk_bytes
        return True


def _hit_prefix(reply: Any, n: int) -> tuple[int, int]:
    """(leading keys held locally, leading keys held locally or by a peer) of a LookupReply.

    ``reply.local`` keys are in this pod's store and the next ``reply.peer`` on a peer.
    """
    local = max(0, min(int(reply.local), n))
    total = max(local, min(local + int(reply.peer), n))
    return local, total
