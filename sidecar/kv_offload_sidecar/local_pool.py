"""LocalPool: several ``kv-offload sidecar`` processes on 127.0.0.1 (tests, demo, benches)."""

from __future__ import annotations

from typing import Any

from .offloading_config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                OffloadingModelConfig, OffloadingParallelConfig)


def example_config(*, model: str = "Qwen/Qwen3-0.6B", dtype: str = "bfloat16",
                   tokens_per_block: int = 16, blocks_per_chunk: int = 4, tokens_per_hash: int = 16,
                   worker_kv_bytes_per_block: int = 4096, num_layers: int = 2,
                   data_parallel_size: int = 1, extra_config: dict[str, Any] | None = None,
                   engine_id: str = "kv-offload-local") -> OffloadingConfig:
    """A small parallelism-agnostic config: one KV group, 16 KiB chunks by default."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, tuple(f"model.layers.{i}.self_attn.attn"
                                                              for i in range(num_layers)), 0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra_config or {},
        engine_id=engine_id,
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(tokens_per_hash, blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=data_parallel_size,
            data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )
