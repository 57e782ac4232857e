"""A simulated vLLM engine that drives the kv-offload tier exactly as vLLM does.

``SimulatedEngine`` plays vLLM's scheduler and workers for the offloading
path: it hashes a request's tokens into vLLM's prefix chain and chunk keys,
asks the secondary tier for the longest prefix of chunks (``lookup`` every
key each step, ``on_schedule_end``, retry while any answer is RETRY, stop at
the first MISS), loads the hits into rows of its primary region, checks every
loaded byte against the KV it would have computed, "prefills" the rest and
stores it through the tier.

KV tensors are a deterministic function of the tokens, their positions, the
layer and the prefix (through the chunk key): K/V of token t at position p in
layer l are ``sin(a*t + b*p + c*l + d*kv + e*j + salt(chunk key))`` in the
model dtype, split across tensor-parallel workers by head dimension. Rows use
vLLM's layout: ``|W0 slot|W1 slot|...|pad|``, one slot per worker, each slot
the per-layer pages ``[layer0 blocks | layer1 blocks | ...]``.
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.engine.sidecar_match import chunk_bytes_of
from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.engine.vllm_contract import (
    LookupResult,
    ReqContext,
    TransferJob,
)
from kv_offload_sidecar.engine.vllm_tier import KVOffloadSecondaryTier

from kv_offload_testing.prefix_hash import PrefixHasher
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY

_DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "float32": torch.float32, "float": torch.float32, "fp8": torch.uint8,
           "fp8_e4m3": torch.uint8, "uint8": torch.uint8}


@dataclass(frozen=True)
class RowLayout:
    """Geometry of one primary-tier row, as vLLM's SharedOffloadRegion lays it out."""

    # Worker slots per row (1 with the replicated layout).
    workers: int
    # Layers of the single KV-cache group, each one canonical tensor.
    num_layers: int
    # GPU blocks per chunk.
    blocks_per_chunk: int
    # Tokens per GPU block.
    tokens_per_block: int
    # Bytes of one layer's page for one block on one worker.
    page_bytes: int
    # Element type of the KV values.
    dtype: torch.dtype
    # Bytes between row starts: slot bytes rounded up to the page size.
    row_stride: int

    @classmethod
    def from_config(cls, config: OffloadingConfig) -> "RowLayout":
        group = config.groups[0]
        num_layers = len(group.layer_names)
        if config.worker_kv_bytes_per_block % num_layers:
            raise ValueError(f"worker_kv_bytes_per_block {config.worker_kv_bytes_per_block} "
                             f"is not a multiple of the {num_layers} layers")
        workers = 1 if config.replicated_layout else config.parallel.world_size
        chunk = chunk_bytes_of(config)
        stride = slot_stride_for(chunk)
        dtype = _DTYPES.get(str(config.model.dtype).removeprefix("torch."), torch.float16)
        return cls(workers=workers, num_layers=num_layers,
                   blocks_per_chunk=config.cache.blocks_per_chunk,
                   tokens_per_block=group.tokens_per_block,
                   page_bytes=config.worker_kv_bytes_per_block // num_layers,
                   dtype=dtype, row_stride=stride)

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * self.blocks_per_chunk * self.page_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.workers * self.slot_bytes

    @property
    def tokens_per_chunk(self) -> int:
        return self.blocks_per_chunk * self.tokens_per_block

    @property
    def elems_per_token(self) -> int:
        """K (or V) elements of one token on one worker (heads x head_dim / tp)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.page_bytes // (2 * self.tokens_per_block * itemsize)
        if per_token * 2 * self.tokens_per_block * itemsize != self.page_bytes:
            raise ValueError(f"page of {self.page_bytes} bytes does not hold K and V of "
                             f"{self.tokens_per_block} tokens in {self.dtype}")
        return per_token


def chunk_kv_row(layout: RowLayout, token_ids: Sequence[int], first_position: int,
                 key: bytes) -> torch.Tensor:
    """The bytes of one chunk's row (``chunk_bytes`` uint8) the engine would compute."""
    e = layout.elems_per_token
    width = e * layout.workers  # head dimension across all TP workers
    tokens = torch.tensor(list(token_ids), dtype=torch.float64).view(
        layout.blocks_per_chunk, 1, layout.tokens_per_block, 1)
    positions = torch.arange(first_position, first_position + layout.tokens_per_chunk,
                             dtype=torch.float64).view(tokens.shape)
    salt = int.from_bytes(key[:8], "big") / float(1 << 64) * 6.283185307179586
    kv = torch.arange(2, dtype=torch.float64).view(1, 2, 1, 1)
    cols = torch.arange(width, dtype=torch.float64).view(1, 1, 1, width)
    base = tokens * 0.0137 + positions * 0.00091 + kv * 1.37 + cols * 0.0513 + salt
    slots = []
    for w in range(layout.workers):
        pages = []
        for layer in range(layout.num_layers):
            # (blocks, 2, tokens, e): one page per block, K then V.
            vals = torch.sin(base[..., w * e:(w + 1) * e] + layer * 0.731).to(
                torch.float32 if layout.dtype == torch.uint8 else layout.dtype)
            if layout.dtype == torch.uint8:
                vals = ((vals + 1.0) * 127.5).to(torch.uint8)
            pages.append(vals.contiguous().view(torch.uint8).reshape(-1))
        slots.append(torch.cat(pages))
    return torch.cat(slots)


class SimulatedSpec:
    """The parts of vLLM's OffloadingSpec a secondary tier reads."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.config = config
        self.extra_config = config.extra_config
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self.tokens_per_hash = config.cache.tokens_per_hash
        self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)


@dataclass
class RequestResult:
    """What one simulated request did."""

    # Full chunks of the prompt (the offloadable ones).
    chunks: int
    # Leading chunks the tier answered as present.
    hit_chunks: int
    # Chunks loaded and verified (0 when the load failed and the engine recomputed).
    loaded_chunks: int
    # Chunks computed and stored.
    stored_chunks: int
    # Loaded bytes that differ from the KV the engine would compute (must be 0).
    mismatched_bytes: int
    # Seconds from submit_load to its result; None without a load.
    load_seconds: float | None


def _shared_rows(size: int, name: str) -> mmap.mmap:
    """``size`` zeroed bytes of a memfd, mapped shared (the memfd's descriptor stays with the map)."""
    fd = os.memfd_create(f"kv-offload-sim-{name}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class SimulatedEngine:
    """One vLLM engine (one DP rank) with a primary region and the kv-offload tier."""

    def __init__(self, config: OffloadingConfig, *, hash_seed: str, host: str = "127.0.0.1",
                 port: int | None = None, num_rows: int = 64, hash_algo: str = "sha256",
                 step_seconds: float = 0.002, lookup_timeout_seconds: float = 0.5,
                 load_timeout_seconds: float = 5.0, client: Any = None,
                 name: str = "engine", model_identity: ModelIdentity = STAND_IN_IDENTITY) -> None:
        self.config = config
        self.name = name
        self.layout = RowLayout.from_config(config)
        self.hasher = PrefixHasher(config.cache.tokens_per_hash,
                                   config.tokens_per_chunk // config.cache.tokens_per_hash,
                                   seed=hash_seed, hash_algo=hash_algo)
        self.num_rows = num_rows
        # The CPU primary tier: one row per chunk slot in a shared-memory file, as vLLM's
        # SharedOffloadRegion maps it (here an anonymous memfd), so the sidecar can map it too.
        self._region_map = _shared_rows(num_rows * self.layout.row_stride, name)
        self.region = torch.frombuffer(self._region_map, dtype=torch.uint8).view(
            num_rows, self.layout.row_stride)
        self._view = memoryview(self.region.numpy())
        self.tier = KVOffloadSecondaryTier(
            SimulatedSpec(config), self._view, "KVOffloadSecondaryTier", host=host, port=port,
            lookup_timeout_seconds=lookup_timeout_seconds,
            load_timeout_seconds=load_timeout_seconds, client=client,
            model_identity=model_identity)
        self.tier.engine_hash_seed = hash_seed  # what this engine hashes with, not this process's env
        self._step = step_seconds
        self._job_ids = itertools.count()
        self._req_ids = itertools.count()
        self._done: dict[int, bool] = {}

    # ---- vLLM-like request path -------------------------------------------------

    def run_request(self, token_ids: Sequence[int], req_id: str | None = None) -> RequestResult:
        """Lookup -> load -> verify, then prefill and store the rest; returns what happened."""
        keys = self.hasher.chunk_keys(token_ids)[:self.num_rows]
        ctx = ReqContext(req_id=req_id or f"{self.name}-{next(self._req_ids)}")
        self.tier.on_new_request(ctx)
        try:
            hit = self._maximal_prefix(keys, ctx)
            loaded, mismatched, load_s = 0, 0, None
            if hit:
                ok, load_s = self._transfer(True, keys[:hit], ctx)
                if ok:
                    mismatched = self._verify(token_ids, keys[:hit])
                    loaded = hit
            stored = self._prefill_and_store(token_ids, keys, loaded, ctx)
            return RequestResult(chunks=len(keys), hit_chunks=hit, loaded_chunks=loaded,
                                 stored_chunks=stored, mismatched_bytes=mismatched,
                                 load_seconds=load_s)
        finally:
            self.tier.on_request_finished(ctx)

    def expected_row(self, token_ids: Sequence[int], chunk_idx: int, key: bytes) -> torch.Tensor:
        tpc = self.layout.tokens_per_chunk
        return chunk_kv_row(self.layout, token_ids[chunk_idx * tpc:(chunk_idx + 1) * tpc],
                            chunk_idx * tpc, key)

    def close(self) -> None:
        self.tier.shutdown()
        self._view.release()

    # ---- internals ------------------------------------------------------------------

    def _maximal_prefix(self, keys: list[bytes], ctx: ReqContext) -> int:
        """vLLM's _maximal_prefix_lookup, repeated once per step until nothing defers."""
        while True:
            hit, defer = 0, False
            for key in keys:
                result = self.tier.lookup(key, ctx)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.RETRY:
                    defer = True
                    continue
                hit += 1
                if result is LookupResult.HIT_PENDING:
                    defer = True
            self.tier.on_schedule_end(None)
            if not defer:
                return hit
            time.sleep(self._step)

    def _transfer(self, load: bool, keys: list[bytes], ctx: ReqContext,
                  first_row: int = 0) -> tuple[bool, float]:
        job_id = next(self._job_ids)
        rows = np.arange(first_row, first_row + len(keys), dtype=np.int64)
        job = TransferJob(job_id=job_id, keys=keys, chunk_ids=rows, is_promotion=load,
                          req_context=ctx)
        start = time.monotonic()
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        while job_id not in self._done:
            for result in self.tier.get_finished_jobs():
                self._done[result.job_id] = result.success
            if job_id not in self._done:
                time.sleep(self._step / 2)
        return self._done.pop(job_id), time.monotonic() - start

    def _verify(self, token_ids: Sequence[int], keys: list[bytes]) -> int:
        n = self.layout.chunk_bytes
        bad = 0
        for i, key in enumerate(keys):
            expected = self.expected_row(token_ids, i, key)
            bad += int((self.region[i, :n] != expected).sum())
        return bad

    def _prefill_and_store(self, token_ids: Sequence[int], keys: list[bytes], computed: int,
                           ctx: ReqContext) -> int:
        todo = keys[computed:]
        if not todo:
            return 0
        n = self.layout.chunk_bytes
        for j, key in enumerate(todo):
            self.region[computed + j, :n] = self.expected_row(token_ids, computed + j, key)
        ok, _ = self._transfer(False, todo, ctx, first_row=computed)
        return len(todo) if ok else 0


def trace_tokens(hash_ids: Sequence[int], tokens_per_chunk: int,
                 vocab_size: int = 151_936) -> list[int]:
    """Token ids for a Mooncake request: one chunk of tokens per hash id.

    Equal hash ids give equal tokens, so equal hash-id prefixes give equal token
    prefixes (and equal chunk keys); different ids give different tokens.
    """
    out: list[int] = []
    for h in hash_ids:
        base = (int(h) * 2_654_435_761) % vocab_size
        out.extend((base + 7919 * j + (int(h) >> 5)) % vocab_size for j in range(tokens_per_chunk))
    return out
