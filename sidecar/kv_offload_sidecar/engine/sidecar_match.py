"""Fail closed between engine and sidecar: does this pod's sidecar serve the chunks vLLM asks for?

The tier inside vLLM holds the ``OffloadingConfig`` vLLM built for this
engine; the sidecar states the config, chunk size and hash seed it serves
(its local channel's ``info``). Any difference means the bytes the sidecar
hands out are not this engine's KV layout, or its keys name other prefixes,
so the tier must serve only misses and store nothing. ``mismatches`` lists
every differing field as ``"name: engine != sidecar"`` for the one error line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kv_offload_sidecar.engine.contract.offloading_config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    identity_diff,
)

_PARALLEL_INTS = ("rank", "world_size", "tp_size", "pp_size", "pcp_size", "dcp_size",
                  "data_parallel_index", "data_parallel_size")


def engine_config(offloading_spec: Any) -> OffloadingConfig:
    """kv-offload's OffloadingConfig equal to the one vLLM handed the tier (its ``spec.config``).

    vLLM's own frozen structs have the same field names (later releases add a
    few that are not identity); only the fields kv-offload's structs hold are read.
    """
    cfg = getattr(offloading_spec, "config", offloading_spec)
    if isinstance(cfg, OffloadingConfig):
        return cfg
    p = cfg.parallel
    local = getattr(p, "data_parallel_rank_local", None)
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=int(g.tokens_per_block),
                                           layer_names=tuple(str(n) for n in g.layer_names),
                                           group_id=int(getattr(g, "group_id", i)))
                     for i, g in enumerate(cfg.groups)),
        worker_kv_bytes_per_block=int(cfg.worker_kv_bytes_per_block),
        enable_kv_cache_events=bool(cfg.enable_kv_cache_events),
        extra_config={},
        engine_id=str(cfg.engine_id),
        model=OffloadingModelConfig(name=str(cfg.model.name),
                                    dtype=str(cfg.model.dtype).removeprefix("torch.")),
        cache=OffloadingCacheConfig(tokens_per_hash=int(cfg.cache.tokens_per_hash),
                                    blocks_per_chunk=int(cfg.cache.blocks_per_chunk)),
        parallel=OffloadingParallelConfig(
            **{k: int(getattr(p, k, 1 if k.endswith("size") else 0)) for k in _PARALLEL_INTS},
            data_parallel_rank_local=None if local is None else int(local),
            is_parallelism_agnostic=bool(p.is_parallelism_agnostic)),
        replicated_layout=bool(getattr(cfg, "replicated_layout", False)),
        canonical_layout=bool(getattr(cfg, "canonical_layout", False)),
        kv_cache_layout=getattr(cfg, "kv_cache_layout", None),
    )


def mismatches(engine: OffloadingConfig, engine_seed: str | None,
               info: Mapping[str, Any]) -> list[str]:
    """Every field where the sidecar's ``info`` differs from this engine, or [] when they match.

    Compared: the fingerprint (with a field diff when the sidecar states its
    run config), kv_bytes_per_chunk against the sidecar's slot size, and the
    hash seed. An empty or missing fingerprint or seed is a difference. The
    sidecar compares the model identity the engine stated (``peers.model_gate``)
    and says why it refused it (``model_identity_refused``).
    """
    out: list[str] = []
    theirs = info.get("fingerprint")
    if theirs != engine.fingerprint:
        run_config = info.get("run_config")
        fields = []
        if isinstance(run_config, Mapping):
            fields = identity_diff(engine.run_config(), run_config)
        out.extend(fields or [f"fingerprint: {engine.fingerprint} != {theirs or '(none)'}"])
    store = info.get("store") if isinstance(info.get("store"), Mapping) else {}
    slot_bytes = store.get("slot_bytes")
    if slot_bytes != engine.kv_bytes_per_chunk:
        out.append(f"kv_bytes_per_chunk: {engine.kv_bytes_per_chunk} != {slot_bytes}")
    seed = info.get("hash_seed")
    if engine_seed is None or seed is None or str(seed) != str(engine_seed):
        out.append(f"hash_seed: {_seed(engine_seed)} != {_seed(seed)}")
    refused = info.get("model_identity_refused")
    if refused:
        out.append(f"model_identity: {str(refused)[:1000]}")
    return out


def refusal_message(address: tuple[str, int], differences: list[str]) -> str:
    """The one error line a refused sidecar gets in vLLM's log: what differs and what to do."""
    return (f"kv-offload tier: refusing the sidecar at {address[0]}:{address[1]}, its chunks are "
            f"not this engine's ({'; '.join(differences)}); every lookup is a miss and nothing is "
            f"stored until they match. Give the sidecar the ConfigMap translated for this vLLM "
            f"deployment and set PYTHONHASHSEED to the pool's hash seed")


def _seed(seed: object) -> str:
    if seed is None:
        return "(unknown: PYTHONHASHSEED unset)"
    return repr(str(seed))


def chunk_bytes_of(offloading_spec: Any) -> int:
    """kv_bytes_per_chunk of vLLM's OffloadingConfig: bytes of one row's worker slots."""
    config = getattr(offloading_spec, "config", offloading_spec)
    workers = 1 if getattr(config, "replicated_layout", False) else config.parallel.world_size
    return int(config.worker_kv_bytes_per_block) * int(config.cache.blocks_per_chunk) * int(workers)
