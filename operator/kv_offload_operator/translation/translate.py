"""Translate a vLLM deployment into the OffloadingConfig its engines build.

Input: the real ``vllm serve`` command line and the model's Hugging Face
config.json. Output: the frozen ``OffloadingConfig`` that released vLLM's
``build_offloading_config`` (``vllm/distributed/kv_transfer/kv_connector/v1/
offloading/config.py``) produces, so that its fingerprint equals the one
vLLM's P2P tier computes. The rules are those of the vLLM release the engines
run (``vllm_version``; ``vllm_releases``: the newest supported when not given).
``translate`` gives one worker ``rank`` of the engine
with global data-parallel index ``data_parallel_index``; ``pool_config`` gives
what every engine of the deployment shares (the pool's ConfigMap), with no
per-engine value in it. Pure: no I/O, no vLLM import. Every problem is a
``TranslationError`` whose message is one line saying what to change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kv_offload_sidecar.engine.contract.offloading_config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from .kv_cache_geometry import (
    FULL,
    MLA,
    GeometryError,
    KVCacheGeometry,
    kv_cache_geometry,
)
from .vllm_args import VllmServeArgs, parse_vllm_args
from .vllm_releases import V1_RUNNER_REMOVED, VllmRelease, release

OFFLOADING_CONNECTOR = "OffloadingConnector"
_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The layout OffloadingConnector asks for (get_required_kvcache_layout).
DEFAULT_KV_CACHE_LAYOUT = "LBHNC"
_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
_ADD_CONNECTOR_HINT = (
    "add --kv-transfer-config '{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\","
    "\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":10737418240}}' or --kv-offloading-size <GiB>")


class TranslationError(ValueError):
    """The deployment cannot be translated; str() is one line saying what to change."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _env_flag(env: Mapping[str, str], name: str) -> bool | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def _connector_config(args: VllmServeArgs) -> dict[str, Any]:
    """The effective --kv-transfer-config, with --kv-offloading-size applied as vLLM does."""
    ktc = dict(args.kv_transfer_config or {})
    ktc["kv_connector_extra_config"] = dict(ktc.get("kv_connector_extra_config") or {})
    if args.kv_offloading_size is not None:
        if args.kv_offloading_backend != "native":
            raise TranslationError(
                f"--kv-offloading-backend {args.kv_offloading_backend} does not use vLLM's "
                "OffloadingConnector: use --kv-offloading-backend native")
        if _env_flag(args.env, "VLLM_USE_SIMPLE_KV_OFFLOAD"):
            raise TranslationError(
                "VLLM_USE_SIMPLE_KV_OFFLOAD=1 selects SimpleCPUOffloadConnector: unset it to "
                "use OffloadingConnector")
        size = args.kv_offloading_size * (1 << 30)
        ktc["kv_connector"] = OFFLOADING_CONNECTOR
        ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = int(size) if size.is_integer() else size
        ktc["kv_role"] = "kv_both"
    connector = ktc.get("kv_connector")
    if connector is None:
        raise TranslationError(f"the vLLM args configure no KV offloading connector: {_ADD_CONNECTOR_HINT}")
    if ktc.get("kv_role") not in _KV_ROLES:
        raise TranslationError(
            f"--kv-transfer-config kv_role is {ktc.get('kv_role')!r}: set it to one of "
            f"{', '.join(_KV_ROLES)} (kv_both for offloading)")
    if connector == "MultiConnector":
        children = ktc["kv_connector_extra_config"].get("connectors") or []
        offloading = [c for c in children
                      if isinstance(c, Mapping) and c.get("kv_connector") == OFFLOADING_CONNECTOR]
        if not offloading:
            raise TranslationError(
                "--kv-transfer-config MultiConnector has no OffloadingConnector in "
                "kv_connector_extra_config.connectors: add one")
        child = offloading[0]
        return {"kv_connector": OFFLOADING_CONNECTOR, "engine_id": ktc.get("engine_id"),
                "kv_connector_extra_config": dict(child.get("kv_connector_extra_config") or {})}
    if connector != OFFLOADING_CONNECTOR:
        raise TranslationError(
            f"--kv-transfer-config kv_connector is {connector!r}, not OffloadingConnector: "
            f"{_ADD_CONNECTOR_HINT}")
    return ktc


def _extra_int(extra: Mapping[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise TranslationError(
            f"'{key}' in kv_connector_extra_config must be an integer, got {value!r}") from None


def _blocks_per_chunk(extra: Mapping[str, Any], tokens_per_block: Sequence[int]) -> int:
    """build_offloading_config's chunk sizing, with its error messages."""
    blocks_per_chunk_config = _extra_int(extra, "blocks_per_chunk")
    tokens_per_chunk = _extra_int(extra, "block_size")
    if blocks_per_chunk_config is not None and tokens_per_chunk is not None:
        raise TranslationError(
            "Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config.")
    if blocks_per_chunk_config is not None:
        if blocks_per_chunk_config <= 0:
            raise TranslationError("'blocks_per_chunk' must be greater than 0.")
        return blocks_per_chunk_config
    if tokens_per_chunk is None:
        return 1
    unique = set(tokens_per_block)
    if len(unique) != 1:
        raise TranslationError(
            "If 'block_size' is specified in kv_connector_extra_config, there must be at least "
            "one KV cache group, and all groups must have the same block size: set "
            "'blocks_per_chunk' instead.")
    block = unique.pop()
    if tokens_per_chunk <= 0 or tokens_per_chunk % block:
        raise TranslationError(
            f"'block_size'={tokens_per_chunk} in kv_connector_extra_config must be a multiple "
            f"of the GPU KV cache block size ({block} tokens). Use "
            f"{_round_up(max(tokens_per_chunk, 1), block)} instead, or set 'blocks_per_chunk' "
            "to express the chunk size in blocks.")
    return tokens_per_chunk // block


def _tokens_per_hash(args: VllmServeArgs, group_block_sizes: Sequence[int]) -> int:
    """vLLM's resolve_kv_cache_block_sizes hash block size (a connector is active)."""
    unit = args.prefix_match_unit
    if len(group_block_sizes) <= 1:
        bs = group_block_sizes[0]
        if unit not in (None, bs):
            raise TranslationError(
                f"Invalid prefix_match_unit={unit}; with a single KV cache group, prefix-cache "
                f"hits land on the block size ({bs}). Unset it or set it to {bs}.")
        return bs
    tokens_per_hash = unit if unit is not None else math.gcd(*group_block_sizes)
    if any(bs % tokens_per_hash for bs in group_block_sizes):
        raise TranslationError(
            f"Invalid prefix_match_unit={tokens_per_hash}; prefix-cacheable KV cache group "
            f"block sizes must be divisible by prefix_match_unit. Got group block sizes="
            f"{list(group_block_sizes)}.")
    return tokens_per_hash


def _use_v2_model_runner(args: VllmServeArgs, rel: VllmRelease) -> bool:
    """VllmConfig.use_v2_model_runner: on by default unless the env or a feature says no
    (always on where the release has no V1 runner: ``_check_model_runner`` refuses the env)."""
    if not rel.v1_model_runner:
        return True
    explicit = _env_flag(args.env, "VLLM_USE_V2_MODEL_RUNNER")
    if explicit is not None:
        return explicit
    if args.distributed_executor_backend == "external_launcher" and args.pipeline_parallel_size > 1:
        return False
    return True


def _check_model_runner(args: VllmServeArgs, rel: VllmRelease) -> None:
    """A release without the V1 runner stops at start (``validate_environ``) when
    VLLM_USE_V2_MODEL_RUNNER is set to anything but 1: so does the translation."""
    value = args.env.get("VLLM_USE_V2_MODEL_RUNNER")
    if not rel.v1_model_runner and value is not None and value != "1":
        raise TranslationError(f"vLLM {rel.version} does not start with this line: "
                               + V1_RUNNER_REMOVED.format(value=value))


_ONE_NODE_HINT = ("kv-offload's tier runs in the engine core and sees only its own node's "
                  "workers' KV (vLLM 0.34 refuses secondary tiers there; 0.32 and 0.33 start "
                  "and lack the other nodes' share of every chunk): give each engine at most one "
                  "node's GPUs (--tensor-parallel-size x --pipeline-parallel-size) and scale out "
                  "with --data-parallel-size or more replicas")


def _check_single_node(args: VllmServeArgs, nnodes_within_dp: int,
                       accelerators: int | None) -> None:
    """An engine whose workers span nodes cannot offload to kv-offload (``_ONE_NODE_HINT``):
    more than one node per engine (--nnodes), or more workers than the pod's accelerators
    (``accelerators``: the vLLM container's share of its node; None: unknown)."""
    if nnodes_within_dp > 1:
        raise TranslationError(
            f"the vLLM line spans {nnodes_within_dp} nodes per engine (--nnodes {args.nnodes}, "
            f"--data-parallel-size {args.data_parallel_size}): " + _ONE_NODE_HINT)
    world = (args.tensor_parallel_size * args.pipeline_parallel_size
             * args.prefill_context_parallel_size)
    if accelerators is not None and world > accelerators:
        raise TranslationError(
            f"an engine of the vLLM line has {world} workers (tensor {args.tensor_parallel_size} "
            f"x pipeline {args.pipeline_parallel_size} x prefill context "
            f"{args.prefill_context_parallel_size}) but its pod has {accelerators} "
            "accelerators, so its workers span nodes: " + _ONE_NODE_HINT)


# SpeculativeConfig.needs_eagle_block_drop: drafters that read the next token's hidden state.
_LOOKAHEAD_METHODS = ("eagle", "eagle3", "mtp")


def _check_hash_lookahead(args: VllmServeArgs, rel: VllmRelease) -> None:
    """Where the release hashes the drafter's lookahead tokens into block hashes
    (``VllmConfig._resolve_num_hash_lookahead_tokens``: an EAGLE-like method, its block
    drop and lookahead hashes not disabled; OffloadingConnector supports them), the
    pool's chunk keys differ from those of any engine without it for the same prompt,
    and vLLM's fingerprint does not record it: refused, saying how to share anyway."""
    spec = args.speculative_config
    if not rel.hash_lookahead or not spec:
        return
    if spec.get("disable_lookahead_block_hashes") or spec.get("disable_eagle_block_drop"):
        return
    method = spec.get("method")
    fix = ("add \"disable_lookahead_block_hashes\": true to --speculative-config on every pod "
           "of the pool (vLLM's own setting for engines that share a KV store)")
    if method is None and spec.get("model") is not None:
        raise TranslationError(
            f"--speculative-config names a draft model but no method, and vLLM {rel.version} "
            "detects EAGLE/MTP drafters from the checkpoint and then hashes their lookahead "
            "tokens into the chunk keys: state \"method\" in --speculative-config, or " + fix)
    if method in _LOOKAHEAD_METHODS:
        raise TranslationError(
            f"vLLM {rel.version} hashes the {method} drafter's lookahead tokens into its block "
            "hashes, so these engines' chunk keys differ from any engine's without it for the "
            "same prompt and the pool fingerprint cannot tell them apart: " + fix)


def _nnodes_within_dp(args: VllmServeArgs) -> int:
    """ParallelConfig.nnodes_within_dp."""
    if args.nnodes == 1:
        return 1
    local = args.data_parallel_size_local or args.data_parallel_size
    node_groups = max(1, args.data_parallel_size // max(local, 1))
    within = args.nnodes // node_groups
    if args.data_parallel_rank is not None:  # external load balancing
        return max(within, 1)
    if args.nnodes % node_groups:
        raise TranslationError(
            f"--nnodes {args.nnodes} must be divisible by the number of data parallel node "
            f"groups ({node_groups} = --data-parallel-size {args.data_parallel_size} / "
            f"--data-parallel-size-local {local})")
    return within


def _kv_cache_layout(args: VllmServeArgs) -> str:
    requested = args.env.get("VLLM_KV_CACHE_LAYOUT")
    if not requested:
        return DEFAULT_KV_CACHE_LAYOUT
    layout = _LAYOUT_ALIASES.get(requested.upper(), requested.upper())
    if layout not in _LAYOUTS:
        raise TranslationError(
            f"VLLM_KV_CACHE_LAYOUT={requested} is not a KV cache layout: use one of "
            f"{', '.join(_LAYOUTS)} (or NHD/HND)")
    return layout


def _certifiable(geometry: KVCacheGeometry, tp: int) -> bool:
    """The static canonical-layout certification of every layer (spec_certifiable)."""
    total = geometry.total_num_kv_heads
    for group in geometry.groups:
        spec = group.spec
        if spec.kind == MLA:
            continue  # tokens_per_state == 1 and the page divides into tokens
        if not (total % tp == 0 or tp % total == 0):
            return False
        if spec.num_kv_heads != max(1, total // tp):
            return False
    return any(group.layer_names for group in geometry.groups)


def _layout_flags(args: VllmServeArgs, geometry: KVCacheGeometry, canonical_layout: bool,
                  rel: VllmRelease) -> tuple[bool, bool]:
    """(is_parallelism_agnostic, replicated_layout) as build_offloading_config decides them."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    dcp, pcp = args.decode_context_parallel_size, args.prefill_context_parallel_size
    world_size = pp * tp * pcp
    backend = args.distributed_executor_backend or "mp"
    nnodes_within_dp = _nnodes_within_dp(args)
    single = geometry.groups[0].spec if len(geometry.groups) == 1 else None
    # MLA latents are identical on every TP rank unless DCP shards their tokens.
    kv_tp_replicas = tp if geometry.use_mla and dcp == 1 else 1
    replicated_layout = (
        geometry.use_mla and tp > 1 and kv_tp_replicas == tp
        and geometry.worker_kv_bytes_per_block > 0
        and pp == 1 and pcp == 1 and dcp == 1 and world_size == tp
        and backend == "mp" and nnodes_within_dp == 1
    )
    # Only one head-sharded full-attention group on the V1 runner is portable as is
    # (releases without the V1 runner: only canonical pages are).
    is_parallelism_agnostic = (
        not _use_v2_model_runner(args, rel)
        and single is not None and single.kind == FULL
        and single.num_kv_heads * tp == geometry.total_num_kv_heads
        and dcp == 1 and pcp == 1
    )
    if canonical_layout and not is_parallelism_agnostic:
        # Canonical pages are topology-free: certify layer by layer instead.
        is_parallelism_agnostic = (
            _certifiable(geometry, tp) and dcp == 1 and pcp == 1 and world_size == tp)
    if canonical_layout:
        replicated_layout = (
            is_parallelism_agnostic
            and all(g.spec.kind == MLA for g in geometry.groups)
            and nnodes_within_dp == 1
            and (world_size == 1 or backend == "mp")
        )
    return is_parallelism_agnostic, replicated_layout


def translate(vllm_args: Sequence[str] | str | VllmServeArgs, model_config: Mapping[str, Any], *,
              rank: int = 0, data_parallel_index: int | None = None,
              env: Mapping[str, str] | None = None, vllm_version: str | None = None,
              accelerators: int | None = None) -> OffloadingConfig:
    """The OffloadingConfig one worker of one engine of this deployment builds.

    ``vllm_args`` is the ``vllm serve`` command line (string or argv list, or
    an already parsed ``VllmServeArgs``); ``model_config`` the model's HF
    config.json; ``rank`` the worker in [0, world_size) (0 = the scheduler side,
    whose fingerprint is the pool's); ``data_parallel_index`` the engine's
    global DP index (default: the first DP rank the command line runs);
    ``env`` the container's environment variables (override NAME=value
    prefixes of the command line), e.g. ``VLLM_USE_V2_MODEL_RUNNER``;
    ``vllm_version`` the vLLM release the engines run ("0.34"; None: the newest
    supported); ``accelerators`` the GPUs of the pod running the vLLM container
    (None: unknown): an engine with more workers spans nodes and is refused.
    """
    return _build(_parsed(vllm_args, env), model_config, rank=rank,
                  data_parallel_index=data_parallel_index, pool=False,
                  rel=_release(vllm_version), accelerators=accelerators)


def pool_config(vllm_args: Sequence[str] | str | VllmServeArgs, model_config: Mapping[str, Any], *,
                env: Mapping[str, str] | None = None, vllm_version: str | None = None,
                accelerators: int | None = None) -> OffloadingConfig:
    """The OffloadingConfig every engine of this deployment shares: the pool's ConfigMap.

    Equal to ``translate(..., rank=0)`` (same fingerprint) except that nothing
    in it belongs to one engine: ``parallel.data_parallel_index`` is 0,
    ``parallel.data_parallel_rank_local`` None and ``engine_id`` has no
    ``_dp<N>`` suffix. Every pod mounts this one ConfigMap; the DP ranks a pod
    serves come from the pod itself (the webhook's ``--dp-indices``).
    """
    return _build(_parsed(vllm_args, env), model_config, rank=0, data_parallel_index=0, pool=True,
                  rel=_release(vllm_version), accelerators=accelerators)


def _release(vllm_version: str | None) -> VllmRelease:
    try:
        return release(vllm_version)
    except ValueError as exc:
        raise TranslationError(str(exc)) from None


def _parsed(vllm_args: Sequence[str] | str | VllmServeArgs, env: Mapping[str, str] | None) -> VllmServeArgs:
    try:
        args = vllm_args if isinstance(vllm_args, VllmServeArgs) else parse_vllm_args(vllm_args)
    except ValueError as exc:
        raise TranslationError(str(exc)) from None
    if env:
        args = dataclasses.replace(args, env={**args.env, **env})
    return args


def _data_parallel_place(args: VllmServeArgs, index: int | None, *,
                         pool: bool) -> tuple[int, int | None, str]:
    """(data_parallel_index, data_parallel_rank_local, engine_id suffix) of the engine
    with global DP index ``index`` (None: the first the command line runs).

    For the pool: (0, None, ""), no engine's values. vLLM suffixes a DP
    engine's id with ``_dp<index>`` and the engine core sets its pod-local DP
    rank only when DP is on.
    """
    if pool:
        return 0, None, ""
    dp = args.data_parallel_size
    pod_indices = args.pod_dp_indices()
    if index is None:
        index = pod_indices[0] if pod_indices else 0
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < dp:
        raise TranslationError(
            f"data parallel index {index!r} must be in [0, {dp}) (--data-parallel-size {dp})")
    local = pod_indices.index(index) if dp > 1 and index in pod_indices else None
    return index, local, f"_dp{index}" if dp > 1 or index > 0 else ""


def _build(args: VllmServeArgs, model_config: Mapping[str, Any], *, rank: int,
           data_parallel_index: int | None, pool: bool, rel: VllmRelease,
           accelerators: int | None) -> OffloadingConfig:
    """build_offloading_config of release ``rel`` for worker ``rank`` of one engine, or of
    the pool (``pool``)."""
    if not isinstance(model_config, Mapping):
        raise TranslationError("the model config must be a JSON object (the model's config.json)")
    if not args.model:
        raise TranslationError("the vLLM args name no model: give 'vllm serve MODEL ...' or --model MODEL")
    _check_model_runner(args, rel)
    _check_hash_lookahead(args, rel)
    _check_single_node(args, _nnodes_within_dp(args), accelerators)
    ktc = _connector_config(args)
    extra = ktc["kv_connector_extra_config"]

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    dcp, pcp = args.decode_context_parallel_size, args.prefill_context_parallel_size
    if tp % dcp:
        raise TranslationError(
            f"--tensor-parallel-size {tp} must be divisible by --decode-context-parallel-size {dcp}")
    world_size = pp * tp * pcp
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise TranslationError(
            f"rank {rank!r} must be in [0, {world_size}) (world size = pp {pp} x tp {tp} x pcp {pcp})")
    data_parallel_index, data_parallel_rank_local, engine_id_suffix = _data_parallel_place(
        args, data_parallel_index, pool=pool)

    if args.block_size is None and model_config.get("kv_lora_rank") is not None:
        raise TranslationError(
            "MLA models get their block size from the GPU's attention backend (64 for FlashMLA, "
            "128 for CUTLASS MLA): pass --block-size explicitly to vLLM and to kv-offload")
    block_size = args.block_size or rel.default_block_size
    try:
        geometry = kv_cache_geometry(
            model_config,
            block_size=block_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            pp_rank=rank // (tp * pcp),
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
            pp_layer_partition=args.env.get("VLLM_PP_LAYER_PARTITION"),
        )
    except GeometryError as exc:
        raise TranslationError(str(exc)) from None

    # resolve_dcp_kv_block_size: attention blocks span dcp ranks' tokens.
    group_tokens = [g.spec.block_size * dcp for g in geometry.groups]
    tokens_per_hash = _tokens_per_hash(args, group_tokens)
    for tokens in group_tokens:
        if tokens % tokens_per_hash:
            raise TranslationError(
                f"tokens_per_block={tokens} not divisible by tokens_per_hash={tokens_per_hash}: "
                "unset --prefix-match-unit")
    blocks_per_chunk = _blocks_per_chunk(extra, group_tokens)
    groups = tuple(
        OffloadingGroupConfig(tokens_per_block=tokens, layer_names=g.layer_names, group_id=i)
        for i, (g, tokens) in enumerate(zip(geometry.groups, group_tokens))
    )

    canonical_layout = bool(extra.get("canonical_layout", False))
    is_parallelism_agnostic, replicated_layout = _layout_flags(args, geometry, canonical_layout,
                                                               rel)

    engine_id = str(ktc.get("engine_id") or _default_engine_id(args.model)) + engine_id_suffix
    events = args.kv_events_config or {}
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=geometry.worker_kv_bytes_per_block,
        enable_kv_cache_events=bool(events.get("enable_kv_cache_events", False)),
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=args.model, dtype=geometry.cache_dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=tp,
            pp_size=pp,
            pcp_size=pcp,
            dcp_size=dcp,
            data_parallel_index=data_parallel_index,
            data_parallel_size=args.data_parallel_size,
            data_parallel_rank_local=data_parallel_rank_local,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
        kv_cache_layout=_kv_cache_layout(args),
    )


def _default_engine_id(model: str) -> str:
    """vLLM draws a random uuid4; a pool needs a stable one, so derive it from the model."""
    return "kv-offload-" + hashlib.sha256(model.encode("utf-8")).hexdigest()[:12]
