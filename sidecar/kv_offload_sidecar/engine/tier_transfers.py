"""The tier's store and load jobs: its transfer threads, one per direction.

vLLM submits a job under its manager lock and the call returns at once; each
direction's thread takes its jobs in order (as vLLM's own CPU offloading worker
runs one stream per direction), so a load never waits behind a store, and
results come back through a queue vLLM's thread drains (``get_finished_jobs``).
Beside an engine that computes on the host's CPU (``engine_platform``), a store sent
while no other store waits asks the sidecar to pace its copies (``paced``: background
work, lighter on the memory bus vLLM's decoding uses); with stores queued behind it, or
beside an engine computing on a GPU, it runs flat out. The sidecar copies stored rows
into its slots and loaded chunks into vLLM's rows itself when it maps vLLM's
primary region; otherwise this thread copies between rows and the sidecar's
slots with ``ctypes.memmove``, which releases the GIL (one info line says which).
The threads' CPU is counted as the tier's (``cpu_seconds``) before a job is
reported finished. ``drain`` (vLLM's ``drain_jobs``) fails the jobs not yet
started and cancels the running load and store over the local channel, by the ids
the sidecar knows them by (``<prefix>:<job id>``), then waits for the sidecar's answers.
A store is reported successful only when every chunk the sidecar reserved for it
landed; keys it held already or had no room for are skipped, not failed.
A load the sidecar (copying into vLLM's rows itself) has not answered by its deadline
plus ``ROW_COPY_GRACE_SECONDS`` fails; where vLLM's ``JobResult`` has
``deferred_release`` (0.34 on), its result carries an event set only once no byte of
it can land in the rows any more (``tier_releases``), and ``drain`` sets every such
event before it returns, after ``REPLY_GRACE_SECONDS`` at most; earlier releases
report the failure as before (vLLM may reuse the rows at once).
Imports: the standard library and this package's tier modules.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from kv_offload_sidecar.engine.client import REPLY_GRACE_SECONDS, ROW_COPY_GRACE_SECONDS, StoreCut
from kv_offload_sidecar.engine.region_file import copy_released
from kv_offload_sidecar.engine.sidecar_link import SidecarLink
from kv_offload_sidecar.engine.tier_records import Job
from kv_offload_sidecar.engine.tier_releases import DeferredReleases
from kv_offload_sidecar.engine.tier_stats import TierStats
from kv_offload_sidecar.engine.vllm_contract import (
    DEFERRED_RELEASE,
    JobResult,
    TransferJob,
    tier_logger,
)

logger = tier_logger(__name__)

# Seconds between repeated warnings about failing loads.
_LOAD_WARNING_INTERVAL = 10.0
_STOP = object()


class TierTransfers:
    """The transfer thread of one tier and the jobs submitted to it."""

    def __init__(self, link: SidecarLink, rows: memoryview, row_stride: int, chunk_bytes: int,
                 load_timeout: float, region_reason: str, stats: TierStats,
                 stats_lock: threading.Lock, add_cpu: Callable[[float], float], *,
                 paces_stores: bool = True) -> None:
        self._link = link
        # Whether a store with nothing queued behind it asks the sidecar to pace its copies
        # (``engine_platform.paces_stores``: the engine computes on the host's CPU).
        self.paces_stores = paces_stores
        # The tier's view of vLLM's primary rows (None once the tier has shut down).
        self.rows: memoryview | None = rows
        self._row_stride = row_stride
        self._chunk_bytes = chunk_bytes
        self._load_timeout = load_timeout
        self._region_reason = region_reason
        self._stats = stats
        self._stats_lock = stats_lock
        self._add_cpu = add_cpu  # counts this thread's CPU as the tier's; returns the new mark
        self._last_load_warning = 0.0
        self._copy_path_logged: bool | None = None
        # Submitted and not yet reported finished, touched only under vLLM's manager lock.
        self.jobs: dict[int, Job] = {}
        # Each direction's jobs, in the order vLLM submitted them.
        self._queues: dict[str, queue.SimpleQueue] = {"load": queue.SimpleQueue(),
                                                      "store": queue.SimpleQueue()}
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending_transfers = 0
        self._draining = 0
        # The job each direction's thread is running (what drain cancels; None: none), and
        # this tier's prefix of the job ids the sidecar knows them by (vLLM's job ids are
        # unique only per engine).
        self._running: dict[str, Job | None] = dict.fromkeys(self._queues)
        self._job_prefix = secrets.token_hex(6)
        # Failed loads whose rows the stalled sidecar may still write (vLLM 0.34 on; None:
        # the release has no deferred_release, vLLM may reuse such rows at once).
        self.releases: DeferredReleases | None = DeferredReleases() if DEFERRED_RELEASE else None
        self.threads = [threading.Thread(target=self._transfer_worker, args=(kind,),
                                         name=f"kv-offload-{kind}", daemon=True)
                        for kind in self._queues]

    def submit(self, kind: str, job: TransferJob) -> None:
        """Queue vLLM's ``job`` ("store" or "load") for the transfer thread."""
        rows = getattr(job, "chunk_ids", None)
        if rows is None:  # older vLLM: JobMetadata.block_ids
            rows = job.block_ids
        record = Job(kind, int(job.job_id), [bytes(k) for k in job.keys],
                     [int(r) for r in rows], time.monotonic(), getattr(job, "req_context", None))
        self.jobs[record.job_id] = record
        with self._idle:
            self._pending_transfers += 1
        self._queues[kind].put(record)

    def finished(self) -> list[tuple[Job, int, JobResult]]:
        """(job, leading chunks moved, vLLM's result) of each job finished since, no longer
        in ``jobs``; a partly failed load's result names the chunks it did load."""
        out = []
        while True:
            try:
                job_id, moved_count, elapsed, ok, release = self._finished.get_nowait()
            except queue.Empty:
                return out
            job = self.jobs.pop(job_id)
            moved = job.keys[:moved_count] if job.kind == "load" else job.keys
            partial = job.kind == "load" and not ok and moved_count > 0
            deferred = {} if release is None else {"deferred_release": release}
            out.append((job, moved_count, JobResult(
                job_id=job_id, success=ok, successful_keys=tuple(moved) if partial else None,
                transfer_time=elapsed, transfer_bytes=moved_count * self._chunk_bytes,
                **deferred)))

    def drain(self) -> None:
        """Block until every submitted transfer has finished or failed.

        Jobs not yet started fail at once (reported by get_finished_jobs). The load and
        the store in progress are cancelled: the sidecar stops them (no fetch awaited
        further, no copy piece started) and answers with the chunks whole by then, and
        only that answer ends a job, so nothing of vLLM's memory is read or written once
        this returns. A cancelled load reports the chunks it loaded; a cancelled store
        whose chunks did not all land fails (what landed stays in the sidecar). A
        sidecar that does not answer is waited for until the job's deadline
        (``load_timeout_seconds`` for a load, the sidecar's control timeout for a store);
        then every deferred release is set, the sidecars' answers still due awaited
        ``REPLY_GRACE_SECONDS`` at most (``DeferredReleases.release_all``).
        """
        with self._idle:
            self._draining += 1
            running = [job for job in self._running.values() if job is not None]
        try:
            if running:
                try:
                    self._link.cancel([self.sidecar_job_id(job.job_id) for job in running])
                except Exception as exc:  # the jobs then end at their deadlines
                    logger.info("kv-offload: cancelling jobs %s failed: %s",
                                [job.job_id for job in running], exc)
            with self._idle:
                while self._pending_transfers:
                    self._idle.wait(1.0)
            if self.releases is not None:
                self.releases.release_all(REPLY_GRACE_SECONDS)
        finally:
            with self._idle:
                self._draining -= 1

    @property
    def in_flight(self) -> tuple[int, int]:
        """(jobs submitted and not finished, those of them the transfer threads have taken up)."""
        with self._idle:
            pending = self._pending_transfers
        return pending, max(0, pending - sum(q.qsize() for q in self._queues.values()))

    def stop(self) -> None:
        """Have the transfer threads end once the jobs queued before have run (join ``threads``)."""
        for q in self._queues.values():
            q.put(_STOP)

    def _transfer_worker(self, kind: str) -> None:
        mark = time.thread_time()
        jobs = self._queues[kind]
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            started = time.monotonic()
            ok, moved, release = False, 0, None
            with self._idle:  # drain sees this job running, or this sees it draining
                cancelled = bool(self._draining)
                if not cancelled:
                    self._running[kind] = job
            if cancelled:
                logger.info("kv-offload %s job %d cancelled by drain_jobs", job.kind, job.job_id)
            else:
                try:
                    if job.kind == "load":
                        ok, moved, release = self._load(job)
                    else:
                        ok, moved = self._store(job)
                except Exception as exc:
                    logger.warning("kv-offload %s job %d failed: %s", job.kind, job.job_id, exc)
            self._account(job, moved, ok)
            mark = self._add_cpu(mark)  # counted before the job is reported finished
            self._finished.put((job.job_id, moved, time.monotonic() - started, ok, release))
            with self._idle:
                self._running[kind] = None
                self._pending_transfers -= 1
                self._idle.notify_all()

    def sidecar_job_id(self, job_id: int) -> str:
        """The id the sidecar knows vLLM's job ``job_id`` by (what drain cancels)."""
        return f"{self._job_prefix}:{job_id}"

    def _account(self, job: Job, moved: int, ok: bool) -> None:
        with self._stats_lock:
            if job.kind == "load":
                self._stats.load_seconds.append(time.monotonic() - job.submitted)
                self._stats.failed_loads += not ok
                self._stats.bytes_loaded += moved * self._chunk_bytes
            else:
                self._stats.failed_stores += not ok
                self._stats.bytes_stored += moved * self._chunk_bytes
        if job.kind == "load" and not ok:
            now = time.monotonic()
            if now - self._last_load_warning >= _LOAD_WARNING_INTERVAL:
                self._last_load_warning = now
                logger.warning("kv-offload: loaded %d of %d chunks of job %d from the sidecar; "
                               "vLLM recomputes the rest (%d failed loads so far)", moved,
                               len(job.keys), job.job_id, self._stats.failed_loads)

    def _sidecar_copies(self, client: Any) -> bool:
        """Whether ``client``'s sidecar copies rows itself; says once which path is used."""
        attached = bool(getattr(client, "region_attached", False))
        if self._copy_path_logged is not attached:
            self._copy_path_logged = attached
            if attached:
                logger.info("kv-offload tier: the sidecar maps vLLM's primary region and copies "
                            "chunks between its rows and the store (vLLM's process moves no "
                            "KV bytes)")
            else:
                why = getattr(client, "region_reason", "") or self._region_reason
                logger.info("kv-offload tier: the primary region is not shared with the sidecar "
                            "(%s); the tier copies chunks itself, GIL released", why)
        return attached

    def _load(self, job: Job) -> tuple[bool, int, threading.Event | None]:
        """(all loaded, leading chunks of ``job`` copied from the sidecar into their rows,
        the release event of a failed load whose rows the sidecar may still write)."""
        client = self._link.connected()
        if client is None:
            return False, 0, None
        release = None
        if self._sidecar_copies(client):
            loaded, late = client.load_rows_held(job.keys, job.rows, timeout=self._load_timeout,
                                                 job=self.sidecar_job_id(job.job_id),
                                                 hold_late=self.releases is not None)
            if late is not None and self.releases is not None:
                release = self.releases.defer(late)
                logger.warning("kv-offload load job %d: the sidecar has not answered %.1f s past "
                               "its deadline; vLLM holds its %d rows until it does",
                               job.job_id, ROW_COPY_GRACE_SECONDS, len(job.rows))
        else:
            def read(i: int, slot: memoryview) -> None:
                copy_released(self._row(job.rows[i]), slot.cast("B")[:self._chunk_bytes])

            loaded = client.load(job.keys, read, timeout=self._load_timeout,
                                 job=self.sidecar_job_id(job.job_id))
        if not self._link.matches(client):
            loaded = 0  # read from a sidecar that turned out not to match: none of it counts
        return loaded == len(job.keys), loaded, release

    def _store(self, job: Job) -> tuple[bool, int]:
        """(stored, chunks written now); keys the sidecar holds already or has no room
        for are skipped, which is not a failure."""
        client = self._link.connected()
        if client is None:
            return False, 0
        if self._sidecar_copies(client):
            # Paced only beside an engine computing on these cores, and with nothing queued behind it.
            paced = self.paces_stores and self._queues["store"].empty()
            if paced:
                with self._stats_lock:
                    self._stats.paced_stores += 1
            try:
                return True, client.store_rows(job.keys, job.rows, strict=True, paced=paced,
                                               job=self.sidecar_job_id(job.job_id))
            except StoreCut as cut:  # past its deadline, or cancelled by drain
                logger.debug("kv-offload store job %d: %s", job.job_id, cut)
                return False, cut.committed

        def write(i: int, slot: memoryview) -> None:
            copy_released(slot.cast("B")[:self._chunk_bytes], self._row(job.rows[i]))

        return True, client.store(job.keys, write, strict=True)

    def _row(self, row: int) -> memoryview:
        assert self.rows is not None, "kv-offload tier used after shutdown"
        start = row * self._row_stride
        return self.rows[start:start + self._chunk_bytes]


__all__ = ["TierTransfers"]
