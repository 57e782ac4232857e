"""The model identity a ``vllm serve`` command line declares: the ConfigMap's ``model_identity``.

The engine's tier computes the full ``ModelIdentity`` from what vLLM loaded
(``kv_offload_sidecar.engine.vllm_identity``); the operator declares the part of it
the command line states (``DECLARED_FIELDS``), so that a sidecar refuses an engine
that contradicts its pool (``model_identity.declared_mismatches``) and two
deployments whose bytes differ under one fingerprint differ in ``kv-offload
translate``, ``fingerprint`` and ``diff``.

Contract: each declared value is spelled exactly as the engine's tier computes it.
- ``revision``, ``code_revision``: ``--revision``, ``--code-revision`` as given.
- ``quantization``: ``-q/--quantization``, else config.json's
  ``quantization_config.quant_method`` (lower case, ``compressed_tensors`` spelled
  ``compressed-tensors``, as vLLM normalizes it); not declared where the checkpoint is
  quantized with a method vLLM's override pass may run under another name depending
  on the GPU (``gptq`` -> ``gptq_marlin``: ``PLATFORM_RENAMED_METHODS``).
- ``hf_overrides``: ``--hf-overrides`` (dotted overrides merged) as ``overrides_text``
  spells it (its canonical JSON, or a digest of a long one), when not empty.
- ``dtype``: ``--dtype`` as the torch dtype name (``half`` -> ``float16``,
  ``float`` -> ``float32``).
- ``kv_cache_dtype``: ``--kv-cache-dtype`` as given.
- ``block_size``: ``--block-size`` in decimal.
- ``hash_algo``: ``--prefix-caching-hash-algo`` as given.
A field the command line leaves to vLLM (``auto`` or absent) is not declared: only the
engine knows what vLLM chose. Serving flags (``--port``, ``--max-num-seqs``,
``--served-model-name``, ``--gpu-memory-utilization``, ``--seed``), the tokenizer and the
chat template are not identity. The ConfigMap document is ``config_document``:
``OffloadingConfig.to_dict()`` plus ``model_identity`` (which ``OffloadingConfig.from_dict``
ignores; the sidecar reads it with ``model_identity.parse_declared``). Pure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kv_offload_sidecar.engine.contract.model_identity import (
    DECLARED_FIELDS,
    DIGEST_HEX_LEN,
    canonical_json,
    overrides_text,
    parse_declared,
)
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig

from .kv_cache_geometry import GeometryError, resolve_model_dtype
from .translate import TranslationError
from .vllm_args import VllmServeArgs, parse_vllm_args

# The ConfigMap document's key holding the declared identity.
MODEL_IDENTITY_KEY = "model_identity"
# Checkpoint methods vLLM's ``_verify_quantization`` may rename by hardware (Marlin,
# BitBLAS, IPEX kernels, ModelOpt's FP8/FP4 variants, MXFP4 backends): left to the engine.
PLATFORM_RENAMED_METHODS = frozenset({"gptq", "awq", "marlin", "bitblas", "gptq_marlin",
                                      "awq_marlin", "gptq_marlin_24", "modelopt", "mxfp4"})
_AUTO = "auto"


def declared_identity(vllm_args: Sequence[str] | str | VllmServeArgs,
                      model_config: Mapping[str, Any]) -> dict[str, str]:
    """The ``DECLARED_FIELDS`` the command line (and config.json) state, in that order.

    Raises ``TranslationError`` naming the flag whose value cannot be declared.
    """
    try:
        args = vllm_args if isinstance(vllm_args, VllmServeArgs) else parse_vllm_args(vllm_args)
    except ValueError as exc:
        raise TranslationError(str(exc)) from None
    values = {
        "revision": args.revision or "",
        "code_revision": args.code_revision or "",
        "quantization": _quantization(args, model_config),
        "hf_overrides": overrides_text(dict(args.hf_overrides or {})),
        "dtype": _dtype(args, model_config),
        "kv_cache_dtype": "" if args.kv_cache_dtype == _AUTO else args.kv_cache_dtype,
        "block_size": "" if args.block_size is None else str(args.block_size),
        "hash_algo": args.prefix_caching_hash_algo or "",
    }
    return {name: values[name] for name in DECLARED_FIELDS if values[name]}


def _checkpoint_quant_method(model_config: Mapping[str, Any]) -> str:
    """config.json's quant_method as vLLM normalizes it ("" when not quantized)."""
    for holder in (model_config, model_config.get("text_config") or {}):
        if not isinstance(holder, Mapping):
            continue
        quant = holder.get("quantization_config") or holder.get("compression_config")
        if isinstance(quant, Mapping) and quant.get("quant_method"):
            return str(quant["quant_method"]).lower().replace("compressed_tensors",
                                                              "compressed-tensors")
    return ""


def _quantization(args: VllmServeArgs, model_config: Mapping[str, Any]) -> str:
    checkpoint = _checkpoint_quant_method(model_config)
    method = args.quantization or checkpoint
    if checkpoint and method in PLATFORM_RENAMED_METHODS:
        return ""
    return method


def _dtype(args: VllmServeArgs, model_config: Mapping[str, Any]) -> str:
    if args.dtype.lower() == _AUTO:
        return ""
    try:
        return resolve_model_dtype(model_config, args.dtype)
    except GeometryError as exc:
        raise TranslationError(str(exc)) from None


def declared_digest(declared: Mapping[str, str]) -> str:
    """First 16 hex of sha256 over the canonical JSON of the declared fields."""
    text = canonical_json(parse_declared(declared))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_HEX_LEN]


def describe(declared: Mapping[str, str]) -> str:
    """``revision=abc123 quantization=fp8`` (``DECLARED_FIELDS`` order), or ``none stated``."""
    stated = parse_declared(declared)
    if not stated:
        return "none stated (the engine decides every field)"
    return " ".join(f"{name}={stated[name]}" for name in DECLARED_FIELDS if name in stated)


def declared_diff(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """Each declared field that differs, as ``model_identity.revision: "abc123" != "def456"``."""
    sa, sb = parse_declared(a), parse_declared(b)
    return [f"{MODEL_IDENTITY_KEY}.{name}: {_shown(sa.get(name))} != {_shown(sb.get(name))}"
            for name in DECLARED_FIELDS if sa.get(name) != sb.get(name)]


def _shown(value: str | None) -> str:
    return json.dumps(value) if value else "<not declared>"


def config_document(config: OffloadingConfig, declared: Mapping[str, str]) -> dict[str, Any]:
    """The ConfigMap's ``offloading_config.json`` as a dict: the config plus ``model_identity``."""
    return {**config.to_dict(), MODEL_IDENTITY_KEY: parse_declared(declared)}


def config_json(config: OffloadingConfig, declared: Mapping[str, str]) -> str:
    """``config_document`` as the JSON text the ConfigMap and ``kv-offload translate`` hold."""
    return json.dumps(config_document(config, declared), indent=2)


def status_text(declared: Mapping[str, str]) -> str:
    """The pool's ``status.declaredModelIdentity``: the canonical JSON of the declared fields
    (one string, so a merge patch replaces it whole; ``{}`` when none is stated)."""
    return canonical_json(parse_declared(declared))
