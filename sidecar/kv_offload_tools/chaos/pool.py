"""The pool the chaos runs act on: a LocalPool with the chaos bench's settings."""

from __future__ import annotations

from collections.abc import Sequence

from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig

from kv_offload_testing.local_pool import LocalPool, example_config

# Hash seed written into the chaos pool's config (no dependence on PYTHONHASHSEED).
CHAOS_HASH_SEED = "kv-offload-chaos"
# Data planes a chaos run can drive (not ucx: its chunk bytes bypass the fault proxy and no
# scenario damages them yet).
CHAOS_TRANSPORTS = ("tcp", "nixl")


def require_transport(transport: str) -> None:
    """Make sure this process can drive sidecars of ``transport``; ValueError (one line) if not.

    ``nixl``: the chaos harness itself READs with NIXL (its probes), so NIXL's UCX environment
    is set before ``nixl_cu12`` is imported here (``configure_nixl_env``: UCX's own transport
    choice unless ``UCX_TLS`` says otherwise; cma between processes of this host), and the
    import is tried now rather than in the middle of a run.
    """
    if transport not in CHAOS_TRANSPORTS:
        raise ValueError(f"--transport {transport} is not one of {', '.join(CHAOS_TRANSPORTS)}")
    if transport != "nixl":
        return
    from kv_offload_sidecar.data.nixl.runtime import configure_nixl_env, import_nixl

    try:
        configure_nixl_env()
        import_nixl()
    except (ValueError, RuntimeError, ImportError, OSError) as exc:
        raise ValueError(f"kv-offload bench chaos --transport nixl: {exc}") from None


def chaos_config(chunk_bytes: int) -> OffloadingConfig:
    """The example config with ``chunk_bytes``-byte chunks and the chaos hash seed."""
    if chunk_bytes % 4:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of 4")
    return example_config(worker_kv_bytes_per_block=chunk_bytes // 4, blocks_per_chunk=4,
                          extra_config={"hash_seed": CHAOS_HASH_SEED})


def chaos_pool(chunk_bytes: int, capacity_bytes: int, *, fetch_deadline_seconds: float = 1.0,
               shutdown_grace_seconds: float = 3.0, transport: str = "tcp",
               extra_args: Sequence[str] = ()) -> LocalPool:
    """An empty pool (sidecars join with ``add``, by identity) of ``transport`` sidecars logging
    warnings (``extra_args``: flags of every sidecar, e.g. TLS certificates)."""
    return LocalPool(0, transport=transport, config=chaos_config(chunk_bytes), capacity_bytes=capacity_bytes,
                     fetch_deadline_seconds=fetch_deadline_seconds, extra_args=extra_args,
                     shutdown_grace_seconds=shutdown_grace_seconds, log_level="WARNING")
