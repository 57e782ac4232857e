"""The KV-cache geometry vLLM builds for a model, derived from its HF config.json.

Mirrors what released vLLM computes without a GPU: each attention layer's
KV-cache spec on one worker (``vllm/v1/kv_cache_interface.py``: page bytes =
kv heads x block size x (K + V head size) x dtype bytes; MLA keeps one latent
of ``kv_lora_rank + qk_rope_head_dim`` per token), the grouping of layers into
KV-cache groups (``_get_kv_cache_groups_uniform_page_size``: one group per
attention type, split to equal sizes, layers dealt round-robin), the layers a
pipeline stage owns (``get_pp_indices``) and the bytes one block takes on one
worker. Errors are ``GeometryError`` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# kind of a layer's KV cache spec
FULL = "full_attention"
SLIDING = "sliding_attention"
MLA = "mla"

# vLLM's _STR_DTYPE_TO_TORCH_DTYPE, by the name str(torch dtype) ends in.
_MODEL_DTYPES = {"half": "float16", "float16": "float16", "float": "float32",
                 "float32": "float32", "bfloat16": "bfloat16"}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# --kv-cache-dtype values with a plain one-element-per-value page.
_CACHE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
                      "fp8_e5m2": 1, "fp8_inc": 1}
# vLLM's _FLOAT16_NOT_SUPPORTED_MODELS.
_NO_FLOAT16 = ("gemma2", "gemma3", "gemma3_text", "glm4")
# Architectures whose attention module is not named self_attn.
_ATTENTION_MODULE = {"GptOssForCausalLM": "attn"}
_HYBRID_SSM_KEYS = ("layers_block_type", "attn_layer_period", "hybrid_override_pattern",
                    "mamba_d_state", "ssm_cfg", "linear_num_value_heads")


class GeometryError(ValueError):
    """The model config cannot be turned into vLLM's KV-cache geometry."""


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV cache on one worker (vLLM's AttentionSpec)."""

    # FULL, SLIDING or MLA.
    kind: str
    # Tokens per GPU block (before DCP scaling).
    block_size: int
    # KV heads held by one worker (1 for MLA; replicated when total < TP).
    num_kv_heads: int
    # K head size in elements (MLA: kv_lora_rank + qk_rope_head_dim).
    head_size: int
    # V head size in elements (0 for MLA, which stores one latent).
    head_size_v: int
    # Bytes per element of the KV cache dtype.
    dtype_bytes: int
    # Sliding window in tokens for SLIDING layers, else None.
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer on one worker."""
        return self.num_kv_heads * self.block_size * (self.head_size + self.head_size_v) * self.dtype_bytes


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table (vLLM's KVCacheGroupSpec)."""

    # Layer names, e.g. "model.layers.0.self_attn.attn".
    layer_names: tuple[str, ...]
    # The spec every layer of the group has.
    spec: LayerSpec


@dataclass(frozen=True)
class KVCacheGeometry:
    """The KV cache of one worker as vLLM lays it out."""

    # Groups as the worker sees them (layers of its pipeline stage only).
    groups: tuple[KVCacheGroup, ...]
    # Bytes one block takes on this worker: the largest group's pages.
    worker_kv_bytes_per_block: int
    # KV heads of the whole model (vLLM's get_total_num_kv_heads).
    total_num_kv_heads: int
    # True for multi-head latent attention models (DeepSeek-V2/V3 style).
    use_mla: bool
    # Model dtype name, e.g. "bfloat16" (after --dtype resolution).
    model_dtype: str
    # KV cache dtype name, e.g. "bfloat16" or "fp8" (vLLM's OffloadingModelConfig.dtype).
    cache_dtype: str


def _optional_positive(cfg: Mapping[str, Any], name: str) -> int | None:
    """``cfg[name]``, a positive integer, or None when the model config has no such field."""
    value = cfg.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise GeometryError(f"model config '{name}' must be a positive integer, got {value!r}")
    return value


def _positive(cfg: Mapping[str, Any], name: str) -> int:
    """``cfg[name]``, a positive integer the geometry cannot do without."""
    value = _optional_positive(cfg, name)
    if value is None:
        raise GeometryError(
            f"model config has no '{name}': give the model's Hugging Face config.json "
            f"(architectures without '{name}' are not supported)")
    return value


def resolve_model_dtype(model_config: Mapping[str, Any], dtype: str) -> str:
    """The model dtype vLLM runs with for ``--dtype`` (vLLM's _get_and_verify_dtype)."""
    config_dtype = model_config.get("torch_dtype") or model_config.get("dtype") or "float32"
    config_dtype = str(config_dtype).removeprefix("torch.")
    if config_dtype not in _MODEL_DTYPES:
        raise GeometryError(
            f"model config torch_dtype {config_dtype!r} is not one of float16, bfloat16, float32")
    config_dtype = _MODEL_DTYPES[config_dtype]
    model_type = str(model_config.get("model_type", ""))
    requested = dtype.lower()
    if requested == "auto":
        # float32 checkpoints are downcast to the GPU's preferred dtype.
        return "bfloat16" if config_dtype == "float32" else config_dtype
    if requested not in _MODEL_DTYPES:
        raise GeometryError(
            f"--dtype {dtype!r} is not one of auto, half, float16, bfloat16, float, float32")
    resolved = _MODEL_DTYPES[requested]
    if resolved == "float16" and model_type in _NO_FLOAT16:
        raise GeometryError(
            f"--dtype {dtype}: the model type {model_type!r} does not support float16; "
            "use bfloat16 or float32 instead")
    return resolved


def resolve_cache_dtype(model_config: Mapping[str, Any], kv_cache_dtype: str,
                        model_dtype: str) -> tuple[str, int]:
    """(dtype name for the config, bytes per element) for ``--kv-cache-dtype``."""
    if kv_cache_dtype == "auto":
        quant = model_config.get("quantization_config")
        if isinstance(quant, Mapping) and any(
                k in quant or k in (quant.get("quantization") or {})
                for k in ("kv_cache_scheme", "kv_cache_quant_algo")):
            raise GeometryError(
                "the model's quantization_config sets a KV cache scheme: pass "
                "--kv-cache-dtype explicitly (e.g. --kv-cache-dtype fp8)")
        return model_dtype, _DTYPE_BYTES[model_dtype]
    if kv_cache_dtype not in _CACHE_DTYPE_BYTES:
        raise GeometryError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not supported by kv-offload; use one of "
            f"auto, {', '.join(_CACHE_DTYPE_BYTES)}")
    return kv_cache_dtype, _CACHE_DTYPE_BYTES[kv_cache_dtype]


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int) -> list[tuple[str, int | None]]:
    """(kind, sliding window) per layer, as vLLM's models read the config."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or window in (None, 0):
        window = None
    elif isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise GeometryError(f"model config 'sliding_window' must be a positive integer, got {window!r}")
    layer_types = cfg.get("layer_types")
    if layer_types is None and window is not None:
        pattern = cfg.get("sliding_window_pattern")
        if cfg.get("model_type") == "gemma2":
            pattern = 2
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            # transformers' Gemma2/Gemma3 default: every pattern-th layer is global.
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if layer_types is None:
        # No per-layer types: vLLM gives every layer the model-level window.
        return [(SLIDING, window) if window else (FULL, None)] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise GeometryError(
            f"model config 'layer_types' must list one type per layer ({num_layers}), "
            f"got {layer_types!r:.80}")
    kinds: list[tuple[str, int | None]] = []
    for i, kind in enumerate(layer_types):
        if kind == FULL or (kind == SLIDING and window is None):
            kinds.append((FULL, None))
        elif kind == SLIDING:
            kinds.append((SLIDING, window))
        else:
            raise GeometryError(
                f"model config layer_types[{i}] is {kind!r}: only full_attention and "
                "sliding_attention layers are supported (no Mamba/linear-attention hybrids)")
    return kinds


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int,
                   partition: str | None = None) -> tuple[int, int]:
    """Layers [start, end) of one pipeline stage (vLLM's get_pp_indices)."""
    if partition:
        try:
            parts = [int(p) for p in partition.split(",")]
        except ValueError:
            raise GeometryError(f"VLLM_PP_LAYER_PARTITION {partition!r} is not a list of integers") from None
        if len(parts) != pp_size or sum(parts) != num_layers:
            raise GeometryError(
                f"VLLM_PP_LAYER_PARTITION {partition!r} must have {pp_size} entries "
                f"summing to {num_layers}")
    else:
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def _group_layers(names: list[str], specs: list[LayerSpec]) -> list[KVCacheGroup]:
    """vLLM's grouping: one group if uniform, else equal-size groups per type."""
    buckets: dict[LayerSpec, list[str]] = {}
    for name, spec in zip(names, specs):
        buckets.setdefault(spec, []).append(name)
    if len(buckets) == 1:
        ((spec, layers),) = buckets.items()
        return [KVCacheGroup(tuple(layers), spec)]
    if len({s.page_size_bytes for s in buckets}) != 1:
        raise GeometryError(
            "the model's attention layers have different KV page sizes per type; "
            "kv-offload supports hybrids whose layer types share head geometry")
    sizes = [len(v) for v in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups: list[KVCacheGroup] = []
    for spec, layers in buckets.items():
        num_groups = math.ceil(len(layers) / group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroup(tuple(layers[i::num_groups]), spec))
    return groups


def kv_cache_geometry(
    model_config: Mapping[str, Any],
    *,
    block_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pp_rank: int = 0,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    disable_hybrid_kv_cache_manager: bool = False,
    pp_layer_partition: str | None = None,
) -> KVCacheGeometry:
    """The KV-cache groups and per-block bytes of one worker of one engine."""
    if not isinstance(model_config, Mapping):
        raise GeometryError("model config must be a JSON object (the model's config.json)")
    cfg = model_config
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, Sequence) and archs and isinstance(archs[0], str) else ""
    name = arch or str(cfg.get("model_type") or "this model")
    if "num_attention_heads" not in cfg:
        raise GeometryError(
            f"model config has no 'num_attention_heads' ({name} has no attention layers, e.g. "
            "a Mamba model): kv-offload supports attention models only")
    ssm_key = next((k for k in _HYBRID_SSM_KEYS if k in cfg), None)
    if ssm_key is not None or "mamba" in str(cfg.get("model_type", "")):
        raise GeometryError(
            f"model config has '{ssm_key or 'model_type'}': {name} mixes Mamba/linear-attention "
            "layers with attention, and kv-offload supports attention-only models")
    num_layers = _positive(cfg, "num_hidden_layers")
    model_dtype = resolve_model_dtype(cfg, dtype)
    cache_dtype, dtype_bytes = resolve_cache_dtype(cfg, kv_cache_dtype, model_dtype)
    use_mla = cfg.get("kv_lora_rank") is not None
    tp = tensor_parallel_size
    num_heads = _positive(cfg, "num_attention_heads")
    if num_heads % tp:
        raise GeometryError(
            f"Total number of attention heads ({num_heads}) must be divisible by tensor "
            f"parallel size ({tp}): change --tensor-parallel-size")
    if use_mla:
        kv_lora_rank = _positive(cfg, "kv_lora_rank")
        rope = _positive(cfg, "qk_rope_head_dim")
        total_kv_heads = _optional_positive(cfg, "num_key_value_heads") or num_heads
        base = LayerSpec(MLA, block_size, 1, kv_lora_rank + rope, 0, dtype_bytes)
        kinds: list[tuple[str, int | None]] = [(MLA, None)] * num_layers
    else:
        total_kv_heads = _optional_positive(cfg, "num_key_value_heads") or num_heads
        head_dim = _optional_positive(cfg, "head_dim")
        if head_dim is None:
            hidden = _positive(cfg, "hidden_size")
            if hidden % num_heads:
                raise GeometryError(
                    f"model config hidden_size {hidden} is not a multiple of num_attention_heads "
                    f"{num_heads}: add 'head_dim'")
            head_dim = hidden // num_heads
        base = LayerSpec(FULL, block_size, max(1, total_kv_heads // tp), head_dim, head_dim,
                         dtype_bytes)
        kinds = _layer_kinds(cfg, num_layers)
        if disable_hybrid_kv_cache_manager:
            kinds = [(FULL, None)] * num_layers  # vLLM unifies every layer to full attention
    module = _ATTENTION_MODULE.get(arch, "self_attn")
    names = [f"model.layers.{i}.{module}.attn" for i in range(num_layers)]
    specs = [LayerSpec(kind, base.block_size, base.num_kv_heads, base.head_size,
                       base.head_size_v, base.dtype_bytes, window) for kind, window in kinds]
    groups = _group_layers(names, specs)
    # A pipeline stage keeps the global grouping, restricted to its own layers.
    start, end = pp_layer_range(num_layers, pp_rank, pipeline_parallel_size, pp_layer_partition)
    own = set(names[start:end])
    groups = [KVCacheGroup(tuple(n for n in g.layer_names if n in own), g.spec) for g in groups]
    bytes_per_block = max(g.spec.page_size_bytes * len(g.layer_names) for g in groups)
    return KVCacheGeometry(
        groups=tuple(groups),
        worker_kv_bytes_per_block=bytes_per_block,
        total_num_kv_heads=total_kv_heads,
        use_mla=use_mla,
        model_dtype=model_dtype,
        cache_dtype=cache_dtype,
    )
