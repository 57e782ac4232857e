"""kv-offload as a vLLM secondary tier: offloaded chunks flow through the pod's sidecar.

vLLM's ``TieringOffloadingSpec`` keeps offloaded chunks in a CPU primary tier (one
shared-memory row per chunk) and cascades them to secondary tiers. This module is such a
tier, loaded from ``module_path``: it hands the file behind vLLM's primary region to the
sidecar once per attachment (a descriptor over the local channel), and the sidecar itself
copies stored rows into its slots and loaded chunks into vLLM's rows (fetching from a peer
pod first when needed), so vLLM's engine process moves no KV bytes; lookups ask the sidecar
which chunks the pool holds. vLLM resolves an out-of-tree tier class as
``getattr(import_module(module_path), type)``, so ``type`` is the class name.

Add to ``vllm serve`` (``cpu_bytes_to_use`` is the primary tier's size)::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
        "cpu_bytes_to_use":8589934592,"block_size":64,
        "secondary_tiers":[{"type":"KVOffloadSecondaryTier",
                            "module_path":"kv_offload_sidecar.engine.vllm_tier"}]}}'

Tier keys (all optional): ``host`` and ``port`` (the sidecar's control host and
base port; default ``VLLM_P2P_SIDE_CHANNEL_HOST`` / ``VLLM_P2P_SIDE_CHANNEL_PORT``,
i.e. ``localhost:5710``; this engine's global data-parallel index is added to
the port), ``lookup_timeout_seconds`` (a lookup unanswered by then is a miss),
``load_timeout_seconds`` (a load not finished by then fails; vLLM recomputes),
``locality`` (``REMOTE``, the default, or ``LOCAL``), ``enable_kv_events``, and
vLLM's own ``backpressure`` (handled by vLLM, honoured through the base class).

Releases: vLLM 0.32, 0.33 and 0.34 load it unchanged (``vllm_contract`` says what differs).
From 0.34 on, a load the tier gives up on while its sidecar may still write vLLM's rows
(no answer by the deadline plus ``ROW_COPY_GRACE_SECONDS``) carries
``JobResult.deferred_release``, set once no byte can land any more (``tier_releases``),
and ``drain_jobs`` sets every such event before it returns; store events carry the
request's ``req_context``. An engine whose workers span nodes cannot use the tier (it
sees only its own node's slots of each chunk): vLLM 0.34 refuses to start one, and
kv-offload's operator refuses such a pool whatever the release.

Never needed: with no sidecar the tier runs detached (``sidecar_link``): misses, one warning.
Fail closed: at each (re)connection the tier compares the sidecar's fingerprint, chunk size, hash
seed and model identity (``vllm_identity``) with vLLM's; on any difference it logs one error
line naming the fields, answers MISS and stores nothing until one matches.

Threading: every SecondaryTierManager method runs under vLLM's manager lock and returns
at once. Lookups are batched per scheduler step (flushed in ``on_schedule_end``): vLLM's
thread sends them itself once the sidecar is attached and checked (else the lookup thread,
which connects and checks first), and its first lookup of each step reads the answers that
came, one non-blocking read each (``pending_lookup``): no other thread needs the GIL between
the sidecar's answer and HIT. Transfers run on transfer threads (``tier_transfers``); results
come back through queues. A peer hit is answered once the holder's count is back (the chunks
keep coming; the load waits for them), with ``known_at`` (CLOCK_MONOTONIC): the steps from
there to vLLM's HIT are counted (``tier_stats``). The CPU of the tier's own code in vLLM's
process (its threads, and vLLM's thread inside the entry points, by ``time.thread_time()``)
is ``vllm:kv_offload_tier_cpu_seconds``. Imports: the standard library, numpy, the tier modules.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from kv_offload_sidecar.engine.engine_platform import engine_paces_stores
from kv_offload_sidecar.engine.pending_lookup import MISS, LookupReply, PendingLookup
from kv_offload_sidecar.engine.sidecar_attachment import RowRegion
from kv_offload_sidecar.engine.region_file import find_region_file
from kv_offload_sidecar.engine.sidecar_link import SidecarLink, sidecar_address
from kv_offload_sidecar.engine.tier_records import KeyState, hit_prefix, locality_of
from kv_offload_sidecar.engine.sidecar_match import chunk_bytes_of, engine_config
from kv_offload_sidecar.engine.tier_stats import (
    HIT_STEPS_TARGET,
    StatsReporter,
    TierStats,
    metric_definitions,
)
from kv_offload_sidecar.engine.tier_transfers import TierTransfers
from kv_offload_sidecar.engine.vllm_contract import (
    EVENT_REQ_CONTEXT,
    CacheHitSource,
    JobResult,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTierManager,
    TransferJob,
    tier_logger,
)

logger = tier_logger(__name__)

# Tier-entry keys vLLM may pass to any tier and this tier does not use.
_GENERIC_TIER_KEYS = frozenset({"name"})
_VALID_KEYS = ("host, port, lookup_timeout_seconds, load_timeout_seconds, locality, "
               "enable_kv_events, backpressure")
# Most keys a lookup vLLM's thread sends itself (a frame of ~38 KB, which a local socket's
# buffer takes at once, so the send never waits on the sidecar); longer ones go by the thread.
_DIRECT_LOOKUP_KEYS = 512
# Latest scheduler steps whose end times the tier keeps (to count steps after an answer).
_STEP_HISTORY = 4096
_STOP = object()
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _counts_cpu(method: _Method) -> _Method:
    """An entry point vLLM's scheduler thread calls: its CPU time goes to ``stats.cpu_seconds``."""
    @functools.wraps(method)
    def wrapper(self: KVOffloadSecondaryTier, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._add_cpu(start)
    return wrapper  # type: ignore[return-value]


class KVOffloadSecondaryTier(SecondaryTierManager):
    """vLLM secondary tier backed by the pod's kv-offload sidecar."""

    # Chunks live in the sidecar's host memory, on this pod or a peer's.
    medium: ClassVar[Medium | None] = Medium.CPU
    # vLLM reports the tokens this tier supplies as peer-to-peer cache hits.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                 tier_type: str = "KVOffloadSecondaryTier",
                 backpressure_detector: Any = None, host: str | None = None,
                 port: int | str | None = None, lookup_timeout_seconds: float = 0.5,
                 load_timeout_seconds: float = 5.0, locality: Any = Locality.REMOTE,
                 enable_kv_events: bool = False, client: Any = None,
                 model_identity: Any = None, **tier_kwargs: Any) -> None:
        unknown = sorted(set(tier_kwargs) - _GENERIC_TIER_KEYS)
        if unknown:
            raise ValueError(f"kv-offload tier: unknown key(s) {unknown} in the secondary_tiers "
                             f"entry; valid keys: {_VALID_KEYS}")
        for name, value in (("lookup_timeout_seconds", lookup_timeout_seconds),
                            ("load_timeout_seconds", load_timeout_seconds)):
            if not float(value) > 0:
                raise ValueError(f"kv-offload tier: {name} must be positive, got {value!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = locality_of(locality)
        self._chunk_bytes = chunk_bytes_of(offloading_spec)
        self._row_stride = self.block_size_bytes  # vLLM's row stride (the base class reads it)
        if self._row_stride < self._chunk_bytes:
            raise ValueError(
                f"kv-offload tier: primary rows are {self._row_stride} bytes but a chunk is "
                f"{self._chunk_bytes} bytes; the tier and vLLM disagree on the chunk geometry")
        # Our only view of vLLM's memory; released at shutdown so vLLM can close its region.
        self._rows: memoryview | None = primary_kv_view.cast("B")
        self._lookup_timeout = float(lookup_timeout_seconds)
        self._load_timeout = float(load_timeout_seconds)
        self._events: list[Any] | None = [] if enable_kv_events else None
        self.stats = TierStats()
        self._region, self._region_reason = self._shared_region()
        self._link = SidecarLink(sidecar_address(offloading_spec, host, port), engine_config(
            offloading_spec), self._chunk_bytes, self._load_timeout, self._set_refused, client,
            self._region, model_identity, on_detached=self._set_detached)
        self.address = self._link.address
        self._reporter = StatsReporter()

        # Caller-side state, touched only under vLLM's manager lock.
        self._keys: OrderedDict[bytes, KeyState] = OrderedDict()
        self._req_keys: dict[str, set[bytes]] = {}
        # Scheduler steps so far, and per request waiting for its first answer: (since, step).
        self._steps = 0
        self._waiting: dict[str, tuple[float, int]] = {}
        # time.monotonic() at the end of each of the latest steps (oldest first).
        self._step_ends: deque[float] = deque(maxlen=_STEP_HISTORY)
        self._batch: dict[str, list[bytes]] = {}
        # Thread hand-offs.
        self._lookup_q: queue.SimpleQueue = queue.SimpleQueue()
        self._lookup_results: queue.SimpleQueue = queue.SimpleQueue()
        # Requests' lookups handed to the lookup thread and not back from it yet.
        self._lookups_in_flight = 0
        # Lookups sent, whose answers vLLM's thread reads: (keys, client or None, lookup).
        self._pending: list[tuple[Sequence[bytes], Any, PendingLookup]] = []
        # The step whose lookups last polled those answers.
        self._polled_step = -1
        self._stats_lock = threading.Lock()
        self._transfers = TierTransfers(self._link, self._rows, self._row_stride,
                                        self._chunk_bytes, self._load_timeout,
                                        self._region_reason, self.stats, self._stats_lock,
                                        self._add_cpu, paces_stores=engine_paces_stores(logger))
        self._jobs = self._transfers.jobs  # submitted and not yet reported finished
        self._threads = [
            threading.Thread(target=self._lookup_worker, name="kv-offload-lookup", daemon=True),
            *self._transfers.threads,
        ]
        for t in self._threads:
            t.start()

    # ---- SecondaryTierManager --------------------------------------------------

    @_counts_cpu
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @_counts_cpu
    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        """HIT / MISS once the sidecar answered; RETRY while asking; MISS past the deadline.

        A key whose load failed stays MISS for the requests that asked for it,
        so vLLM recomputes it at once instead of promoting it again.
        """
        self._drain_lookup_results()
        key = bytes(key)
        state = self._keys.get(key)
        now = time.monotonic()
        if state is None:
            state = self._keys[key] = KeyState(submitted=now)
            if self.stats.refused is not None or self.stats.detached is not None:
                state.result = False  # no sidecar, or a refused one: a miss at once
                if now >= self._link.next_check:  # the lookup thread checks it again (and counts)
                    self._batch.setdefault(req_context.req_id, []).append(key)
                else:
                    with self._stats_lock:
                        self.stats.misses += 1
            else:
                self._batch.setdefault(req_context.req_id, []).append(key)
        state.request_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if state.result is None:
            if now - state.submitted > self._lookup_timeout:
                state.result = False  # unanswered in time: vLLM recomputes
                with self._stats_lock:
                    self.stats.misses += 1
                self._answered(req_context.req_id, now, state)
                return LookupResult.MISS
            self._waiting.setdefault(req_context.req_id, (now, self._steps))
            return LookupResult.RETRY
        self._answered(req_context.req_id, now, state)
        return LookupResult.HIT if state.result else LookupResult.MISS

    def _answered(self, req_id: str, now: float, state: KeyState) -> None:
        """A request that waited (RETRY) got its first answer: count the wait, and for a HIT
        the steps that ended since the sidecar knew it (its ``known_at``)."""
        since = self._waiting.pop(req_id, None)
        if since is None:
            return
        after = None
        if state.result and state.known_at is not None:
            after = 0
            for end in reversed(self._step_ends):  # newest first: stop at the first before it
                if end <= state.known_at:
                    break
                after += 1
        with self._stats_lock:
            self.stats.lookup_waits += 1
            self.stats.lookup_wait_seconds += now - since[0]
            self.stats.lookup_wait_steps += self._steps - since[1]
            if after is not None:
                self.stats.lookup_arrivals += 1
                self.stats.lookup_steps_after_arrival += after
                self.stats.lookup_late_arrivals += after > HIT_STEPS_TARGET

    @_counts_cpu
    def on_schedule_end(self, context: Any = None) -> None:
        """Send this step's lookups: at once when the sidecar's client is ready (checked, no
        re-attachment due; one small send each, no other thread to wake), else through the
        lookup thread, which connects or checks first."""
        self._steps += 1
        now = time.monotonic()
        self._step_ends.append(now)
        if not self._batch:
            return
        client = self._link.ready_client()
        by_thread = {}
        for req_id, keys in self._batch.items():
            if client is not None and len(keys) <= _DIRECT_LOOKUP_KEYS:
                self._pending.append((keys, client, client.lookup_start(
                    keys, self._lookup_timeout, reattach=False)))
            else:
                by_thread[req_id] = keys
        if by_thread:
            with self._stats_lock:
                self._lookups_in_flight += len(by_thread)
            self._lookup_q.put((now, by_thread))
        self._batch = {}

    @property
    def lookups_in_flight(self) -> int:
        """Requests' lookups whose answers have not reached the tier yet (once 0, vLLM's next
        lookup of those keys gets the answers). Read it on vLLM's thread, as lookup()."""
        self._take_handoffs()
        return self._lookups_in_flight + sum(not p.ready() for _, _, p in self._pending)

    @_counts_cpu
    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget lookup answers no live request needs (the pool changes over time)."""
        req_id = req_context.req_id
        self._batch.pop(req_id, None)
        self._waiting.pop(req_id, None)
        for key in self._req_keys.pop(req_id, ()):
            state = self._keys.get(key)
            if state is None:
                continue
            state.request_ids.discard(req_id)
            if not state.request_ids:
                del self._keys[key]

    @_counts_cpu
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._transfers.submit("store", job_metadata)

    @_counts_cpu
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._transfers.submit("load", job_metadata)

    @_counts_cpu
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Finished jobs; the keys of a failed (or partly failed) load become MISS here."""
        out = []
        for job, moved_count, result in self._transfers.finished():
            if job.kind == "load" and not result.success:
                for key in job.keys[moved_count:]:
                    state = self._keys.get(key)
                    if state is not None:
                        state.result = False
            elif job.kind == "store" and result.success and self._events is not None and job.keys:
                origin = {"req_context": job.req_context} if EVENT_REQ_CONTEXT else {}
                self._events.append(OffloadingEvent(keys=list(job.keys), medium=self.medium,
                                                    removed=False, locality=self.locality,
                                                    **origin))
            out.append(result)
        return out

    @_counts_cpu
    def drain_jobs(self) -> None:
        """Block until every submitted transfer has finished or failed; the load and the
        store in progress are cancelled and their answers awaited, and every failed load's
        deferred release is set (``TierTransfers.drain``)."""
        self._transfers.drain()

    @property
    def transfers_in_flight(self) -> tuple[int, int]:
        """(store and load jobs submitted and not finished, those of them the transfer threads
        have taken up, e.g. a load waiting on a stalled sidecar)."""
        return self._transfers.in_flight

    @_counts_cpu
    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._batch or any(
            s.result is None for s in self._keys.values()))

    @_counts_cpu
    def take_events(self) -> Iterable[Any]:
        """OffloadingEvents for chunks stored to the sidecar (with ``enable_kv_events``)."""
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The metrics get_stats() reports, registered by vLLM under these names."""
        return metric_definitions()

    @_counts_cpu
    def get_stats(self) -> Any:
        """vLLM connector stats: lookup results since the last call and the refusal state."""
        with self._stats_lock:
            return self._reporter.report(self.stats)

    def shutdown(self) -> None:
        """Finish or fail every job, stop the threads, close the sidecar client and release
        this tier's view of vLLM's primary memory (vLLM then closes its region)."""
        self.drain_jobs()
        self._lookup_q.put(_STOP)
        self._transfers.stop()
        for t in self._threads:
            t.join()
        if self._transfers.releases is not None:
            self._transfers.releases.close()
        self._take_handoffs()
        for _, _, pending in self._pending:
            pending.close()
        self._pending = []
        self._link.close()
        self._transfers.rows = None
        rows, self._rows = self._rows, None
        if rows is not None:
            rows.release()
        self._primary_kv_view = None  # type: ignore[assignment]

    # ---- internals ------------------------------------------------------------

    def _add_cpu(self, since: float) -> float:
        """Count this thread's CPU time since ``since`` (its ``time.thread_time()``) as the
        tier's; returns the new mark."""
        now = time.thread_time()
        with self._stats_lock:
            self.stats.cpu_seconds += now - since
        return now

    def _shared_region(self) -> tuple[RowRegion | None, str]:
        """vLLM's rows as the sidecar can map them, or (None, why not)."""
        assert self._rows is not None
        found, reason = find_region_file(self._rows)
        if found is None:
            return None, reason
        return RowRegion(found, self._row_stride, self._rows.nbytes // self._row_stride,
                         self._chunk_bytes), ""

    def _take_handoffs(self) -> None:
        """The lookups the lookup thread sent (or failed) since, into ``_pending``."""
        while True:
            try:
                item = self._lookup_results.get_nowait()
            except queue.Empty:
                return
            with self._stats_lock:
                self._lookups_in_flight -= 1
            self._pending.append(item)

    def _drain_lookup_results(self) -> None:
        """Read the answers that came, once per scheduler step (a non-blocking read each, on
        vLLM's thread: no other thread has to get the GIL between an answer and its HIT)."""
        self._take_handoffs()
        if not self._pending or self._polled_step == self._steps:
            return
        self._polled_step = self._steps
        waiting = []
        for keys, client, pending in self._pending:
            reply = pending.poll()
            if reply is None:
                waiting.append((keys, client, pending))
            else:
                self._answer(keys, client, reply)
        self._pending = waiting

    def _answer(self, keys: Sequence[bytes], client: Any, reply: LookupReply) -> None:
        """Record a lookup's answer (client None: a failure the lookup thread counted)."""
        if client is None:
            answers, known_at = [False] * len(keys), None
        else:
            if not self._link.matches_now(client):
                reply = MISS  # answered by a sidecar this engine has not checked: not used
            local, total = hit_prefix(reply, len(keys))
            with self._stats_lock:
                self.stats.lookups += len(keys)
                self.stats.local_hits += local
                self.stats.peer_hits += total - local
                self.stats.misses += len(keys) - total
            answers, known_at = [i < total for i in range(len(keys))], reply.known_at
        for key, present in zip(keys, answers):
            state = self._keys.get(key)
            if state is not None and state.result is None:
                state.result, state.known_at = present, known_at

    def _lookup_worker(self) -> None:
        # Attach now, off vLLM's threads, so the first request's lookup does not pay for the
        # connection and the region hand-off (an absent sidecar is tried again later).
        mark = time.thread_time()
        self._link.attach_early()  # none there: detached (one warning), tried again later
        while True:
            item = self._lookup_q.get()
            if item is _STOP:
                return
            submitted, batch = item
            for keys in batch.values():
                try:
                    self._lookup_batch(keys, submitted)
                finally:
                    mark = self._add_cpu(mark)

    def _lookup_batch(self, keys: Sequence[bytes], submitted: float) -> None:
        """Send one request's lookup; vLLM's thread reads its answer (``_drain_lookup_results``).
        Every batch hands exactly one item back."""
        remaining = self._lookup_timeout - (time.monotonic() - submitted)
        client, pending = None, PendingLookup.answered(MISS)
        if remaining <= 0:
            with self._stats_lock:
                self.stats.lookup_timeouts += 1  # the caller's side answers these keys MISS
        else:
            try:
                client = self._link.connected()
                if client is None:  # refused or detached: every key is a miss
                    with self._stats_lock:
                        self.stats.misses += len(keys)
                else:
                    pending = client.lookup_start(list(keys), timeout=remaining)
            except Exception as exc:  # sidecar down, slow or refusing: every key is a miss
                logger.warning("kv-offload lookup of %d keys failed: %s", len(keys), exc)
                client = None
                with self._stats_lock:
                    self.stats.lookup_timeouts += 1
                    self.stats.misses += len(keys)
        self._lookup_results.put((keys, client, pending))

    @property
    def sidecar_instance(self) -> str | None:
        """The sidecar instance this tier is attached to and has checked (None: not yet).

        A restarted sidecar is noticed at the tier's next operation: a caller that
        restarted it waits until this names the new instance (``/v1/local``'s)."""
        return self._link.instance

    @property
    def engine_hash_seed(self) -> str | None:
        """The seed this engine hashes prefixes with (None: the one vLLM resolved)."""
        return self._link.engine_hash_seed

    @engine_hash_seed.setter
    def engine_hash_seed(self, seed: str | None) -> None:
        self._link.engine_hash_seed = seed

    def _set_refused(self, refused: str | None) -> None:
        with self._stats_lock:
            self.stats.refused = refused

    def _set_detached(self, reason: str | None) -> None:
        with self._stats_lock:
            self.stats.detached = reason  # vllm:kv_offload_tier_detached{reason}


__all__ = ["KVOffloadSecondaryTier"]
