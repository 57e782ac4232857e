"""The model identity of the engine the tier runs in, read from vLLM's own config.

Since vLLM's #48150 an offloading spec carries only the ``OffloadingConfig``, so the tier
finds vLLM's ``VllmConfig`` itself (``find_vllm_config``): the one vLLM set as current,
else the ``vllm_config`` of the scheduler building the tier (a caller's frame: vLLM
builds the tier inside ``Scheduler.__init__`` -> ``OffloadingConnector.__init__``, whose
``vllm_config`` holds the engine's resolved configs). ``engine_identity`` then reads:
- the weights: ``weights_digest.weights_identity`` of the model vLLM loaded (its path, or
  its hub id at the resolved revision);
- ``model_config``: ``revision``, ``code_revision``, ``quantization`` (as vLLM resolved
  it, from the flag or the checkpoint), ``hf_overrides`` and the effective HF config
  (``hf_config.to_dict()`` after the overrides, less the keys that do not change the KV:
  ``NON_KV_CONFIG_KEYS``), ``dtype``;
- ``cache_config``: ``cache_dtype`` ("auto" resolved to the model's dtype), ``block_size``,
  ``prefix_caching_hash_algo``;
- the KV layout: under the canonical layout its format id (topology- and backend-free);
  else ``<backend>/<layout>/<device>``: the attention backend of the engine's layers when
  they live in this process (else the configured one, or ``auto``, which vLLM resolves
  from the platform, release and dtypes), the resolved ``kv_cache_layout``, and the
  device type with its compute capability; and vLLM's release (major.minor).
A field vLLM does not have in a release reads as "". vLLM's own objects come through
``vllm_contract`` (None outside vLLM).
"""

from __future__ import annotations

import hashlib
import inspect
import time
from typing import Any

from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity, canonical_json, overrides_text
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig, canonical_format_id
from kv_offload_sidecar.engine.vllm_contract import (
    current_vllm_config,
    tier_logger,
    vllm_platform,
    vllm_version,
)
from kv_offload_sidecar.engine.weights_digest import weights_identity

logger = tier_logger(__name__)

# Effective-config keys that do not change a chunk's bytes (names, tokenizer ids, versions).
NON_KV_CONFIG_KEYS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
    "_attn_implementation_autoset", "_attn_implementation_internal", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
    "torch_dtype", "dtype", "id2label", "label2id", "return_dict", "output_attentions",
    "output_hidden_states", "use_cache", "chat_template", "task_specific_params"})
# Caller frames searched for the scheduler's ``vllm_config``.
MAX_FRAMES = 40


def find_vllm_config() -> Any | None:
    """vLLM's current ``VllmConfig``, else the nearest caller's ``vllm_config`` (None: none)."""
    current = current_vllm_config()
    if current is not None and getattr(current, "model_config", None) is not None:
        return current
    frame = inspect.currentframe()
    try:
        for _ in range(MAX_FRAMES):
            if frame is None:
                break
            candidate = frame.f_locals.get("vllm_config")
            if type(candidate).__name__ == "VllmConfig":
                return candidate
            frame = frame.f_back
    finally:
        del frame
    return None


def this_engine_identity(config: OffloadingConfig) -> ModelIdentity:
    """This engine's model identity, from the VllmConfig that builds the tier, logged with what
    it cost; outside vLLM (no VllmConfig) one whose weights are unknown, which shares nothing."""
    vllm_config = find_vllm_config()
    if vllm_config is None:
        logger.error("kv-offload tier: no vLLM config to read the model identity from; this "
                     "engine's chunks stay in its pod (pass model_identity outside vLLM)")
        return ModelIdentity()
    identity, what = engine_identity(vllm_config, config)
    logger.info("kv-offload tier: model identity %s: %s", identity.digest, what)
    return identity


def engine_identity(vllm_config: Any, config: OffloadingConfig) -> tuple[ModelIdentity, str]:
    """This engine's identity and a log line saying what was read and what it cost."""
    started = time.monotonic()
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    name = str(getattr(model, "model", "") or config.model.name)
    revision = _text(getattr(model, "revision", None))
    weights = weights_identity(name, revision or None)
    dtype = _dtype(getattr(model, "dtype", ""))
    cache_dtype = _text(getattr(cache, "cache_dtype", ""))
    identity = ModelIdentity(
        weights=weights.identity,
        revision=revision,
        code_revision=_text(getattr(model, "code_revision", None)),
        quantization=_text(getattr(model, "quantization", None)),
        hf_overrides=_overrides(getattr(model, "hf_overrides", None)),
        model_config=_config_digest(getattr(model, "hf_config", None)),
        dtype=dtype,
        kv_cache_dtype=dtype if cache_dtype in ("", "auto") else cache_dtype,
        kv_layout=_kv_layout(vllm_config, config),
        vllm_release="" if config.canonical_layout else _release(),
        block_size=_text(getattr(cache, "block_size", None)),
        hash_algo=_text(getattr(cache, "prefix_caching_hash_algo", None)),
    )
    took = time.monotonic() - started
    what = (f"weights {weights.identity or '<unknown: ' + weights.reason + '>'} "
            f"({weights.files} files, {weights.read_bytes / 2**20:.1f} MiB read, {took:.2f} s)")
    return identity, what


def _text(value: Any) -> str:
    if value is None:
        return ""
    return str(getattr(value, "value", value))


def _dtype(value: Any) -> str:
    return str(value).removeprefix("torch.") if value not in (None, "") else ""


def _overrides(value: Any) -> str:
    if not value:
        return ""
    if callable(value):
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return overrides_text(value)


def _config_digest(hf_config: Any) -> str:
    if hf_config is None:
        return ""
    try:
        d = hf_config.to_dict()
    except Exception:  # noqa: BLE001 - a config vLLM loaded but cannot dump: name it by type
        return f"type:{type(hf_config).__name__}"
    kept = {k: v for k, v in d.items() if k not in NON_KV_CONFIG_KEYS}
    return hashlib.sha256(canonical_json(kept).encode()).hexdigest()[:16]


def _kv_layout(vllm_config: Any, config: OffloadingConfig) -> str:
    if config.canonical_layout and config.kv_cache_layout:
        return canonical_format_id(config.kv_cache_layout)
    cache = getattr(vllm_config, "cache_config", None)
    layout = config.kv_cache_layout or _text(getattr(cache, "kv_cache_layout", None)) or "default"
    return f"{_backend(vllm_config)}/{layout}/{_device()}"


def _backend(vllm_config: Any) -> str:
    """The attention backend of this process's attention layers, else the configured one."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context",
                      None) or {}
    names = set()
    for layer in list(context.values()):
        backend = getattr(layer, "attn_backend", None)
        get_name = getattr(backend, "get_name", None)
        if callable(get_name):
            try:
                names.add(str(get_name()))
            except Exception:  # noqa: BLE001 - a backend without a name: by its class
                names.add(getattr(backend, "__name__", "?"))
    if names:
        return "+".join(sorted(names))
    configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return _text(getattr(configured, "name", configured)) or "auto"


def _device() -> str:
    current_platform = vllm_platform()
    if current_platform is None:
        return "unknown"
    kind = str(getattr(current_platform, "device_type", "") or "unknown")
    try:
        cap = current_platform.get_device_capability()
    except Exception:  # noqa: BLE001 - platforms without a capability (CPU)
        cap = None
    return f"{kind}:{cap.major}.{cap.minor}" if cap is not None and hasattr(cap, "major") else kind


def _release() -> str:
    return ".".join(vllm_version().split(".")[:2])


__all__ = ["engine_identity", "find_vllm_config", "this_engine_identity"]
