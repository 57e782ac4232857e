"""The pool the chaos runs act on: a LocalPool with the chaos bench's settings."""

from __future__ import annotations

from kv_offload_sidecar.engine.offloading_config import OffloadingConfig

from kv_offload_tools.local_pool import LocalPool, example_config

# Hash seed written into the chaos pool's config (no dependence on PYTHONHASHSEED).
CHAOS_HASH_SEED = "kv-offload-chaos"


def chaos_config(chunk_bytes: int) -> OffloadingConfig:
    """The example config with ``chunk_bytes``-byte chunks and the chaos hash seed."""
    if chunk_bytes % 4:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of 4")
    return example_config(worker_kv_bytes_per_block=chunk_bytes // 4, blocks_per_chunk=4,
                          extra_config={"hash_seed": CHAOS_HASH_SEED})


def chaos_pool(chunk_bytes: int, capacity_bytes: int, *, fetch_deadline_seconds: float = 1.0,
               shutdown_grace_seconds: float = 3.0) -> LocalPool:
    """An empty pool (sidecars join with ``add``, by identity) of tcp sidecars logging warnings."""
    return LocalPool(0, config=chaos_config(chunk_bytes), capacity_bytes=capacity_bytes,
                     fetch_deadline_seconds=fetch_deadline_seconds,
                     shutdown_grace_seconds=shutdown_grace_seconds, log_level="WARNING")
