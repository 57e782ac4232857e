"""The KV geometry `bench gpu` measures with: a model's config.json, the pool config a vLLM
deployment of it translates to, and the arithmetic of the fetch-or-recompute trade.

A model is a short name of a config shipped in ``kv_offload_tools/data``
(``llama-3.1-8b``, ``llama-3.1-70b``, ``tiny-llama``) or a path to a Hugging Face
``config.json``. Its pool config is what the operator translates from ``vllm serve MODEL
--block-size 16 --kv-transfer-config {OffloadingConnector, block_size: chunk tokens}`` (one
GPU: tensor parallel 1): ``worker_kv_bytes_per_block x blocks_per_chunk`` bytes per chunk,
which for a Llama in bf16 is ``layers x 2 (K and V) x kv_heads x head_dim x 2 bytes`` per
token (Llama-3.1-8B: 128 KiB per token; 70B: 320 KiB). A prompt's KV is its whole chunks;
vLLM recomputes the tail shorter than a chunk, so the bench moves whole chunks only.

The break-even link rate of a prompt is its KV bytes over its recompute time: a peer hit
delivering its bytes faster than that beats recomputing them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig

# Short name -> config file shipped in kv_offload_tools/data.
SHIPPED_MODELS: dict[str, str] = {
    "llama-3.1-8b": "llama-3.1-8b.config.json",
    "llama-3.1-70b": "llama-3.1-70b.config.json",
    "tiny-llama": "tiny-llama.config.json",
}
# vLLM's block on a GPU (CacheConfig.DEFAULT_BLOCK_SIZE with FlashAttention), in tokens.
GPU_BLOCK_TOKENS = 16
# Bytes per element of the KV cache dtypes a config.json may name (torch_dtype).
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def load_model_config(model: str) -> tuple[str, dict[str, Any]]:
    """(name, config.json as a dict) of a shipped short name or a path to a config.json."""
    if model in SHIPPED_MODELS:
        text = resources.files("kv_offload_tools").joinpath("data", SHIPPED_MODELS[model]).read_text()
        return model, json.loads(text)
    if os.path.isfile(model):
        with open(model, encoding="utf-8") as fh:
            try:
                config = json.load(fh)
            except ValueError as exc:
                raise ValueError(f"model {model!r} is not a JSON config.json: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"model {model!r}: a config.json holds a JSON object")
        return os.path.basename(os.path.dirname(os.path.abspath(model))) or model, config
    raise ValueError(f"model {model!r} is neither a shipped model ({', '.join(SHIPPED_MODELS)}) "
                     "nor a config.json file")


def translate_pool_config(name: str, model_config: Mapping[str, Any], chunk_tokens: int) -> OffloadingConfig:
    """The pool config the operator makes of a one-GPU ``vllm serve`` of the model."""
    from kv_offload_operator.translation.translate import pool_config

    ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "block_size": chunk_tokens}}
    return pool_config(["vllm", "serve", name, "--block-size", str(GPU_BLOCK_TOKENS),
                        "--kv-transfer-config", json.dumps(ktc)], model_config)


@dataclass(frozen=True)
class Geometry:
    """One model's KV shape as vLLM's GPU cache and primary CPU tier hold it."""

    # Model name (the short name, or the folder of its config.json).
    name: str
    # Decoder layers (num_hidden_layers).
    layers: int
    # KV heads per layer (num_key_value_heads).
    kv_heads: int
    # Elements per head (head_dim, else hidden_size / num_attention_heads).
    head_dim: int
    # Bytes per KV element (bf16: 2).
    dtype_bytes: int
    # Tokens per vLLM block (16 on a GPU).
    tokens_per_block: int
    # Blocks per offloaded chunk (the pool config's cache.blocks_per_chunk).
    blocks_per_chunk: int
    # The pool config the sidecars run with.
    pool: OffloadingConfig

    @classmethod
    def of(cls, name: str, model_config: Mapping[str, Any], chunk_tokens: int) -> "Geometry":
        """The geometry of ``model_config`` with chunks of ``chunk_tokens`` tokens."""
        pool = translate_pool_config(name, model_config, chunk_tokens)
        heads = int(model_config["num_attention_heads"])
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
        dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"model {name!r}: torch_dtype {dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
        geometry = cls(name=name, layers=int(model_config["num_hidden_layers"]),
                       kv_heads=int(model_config.get("num_key_value_heads") or heads),
                       head_dim=head_dim, dtype_bytes=_DTYPE_BYTES[dtype],
                       tokens_per_block=pool.groups[0].tokens_per_block,
                       blocks_per_chunk=pool.cache.blocks_per_chunk, pool=pool)
        shaped = geometry.kv_bytes_per_token * geometry.tokens_per_chunk
        if shaped != pool.kv_bytes_per_chunk:
            raise ValueError(f"model {name!r}: {shaped} bytes per chunk from its shape, "
                             f"{pool.kv_bytes_per_chunk} from the translated pool config")
        return geometry

    @property
    def kv_bytes_per_token(self) -> int:
        """layers x 2 (K, V) x kv_heads x head_dim x dtype bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens one chunk holds: its blocks' tokens."""
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk, the pool config's (``of`` checks it against the model's shape):
        a row's payload in vLLM's primary tier."""
        return self.pool.kv_bytes_per_chunk

    @property
    def row_stride(self) -> int:
        """Bytes between the starts of two rows of vLLM's primary tier (page-aligned chunk)."""
        return self.pool.host_chunk_stride_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V): what one GPU cache block holds per layer."""
        return 2 * self.kv_heads * self.tokens_per_block * self.head_dim * self.dtype_bytes

    def chunks(self, tokens: int) -> int:
        """Whole chunks of a prompt of ``tokens`` tokens."""
        return tokens // self.tokens_per_chunk

    def kv_bytes(self, tokens: int) -> int:
        """KV bytes a peer hit of that prompt moves (its whole chunks)."""
        return self.chunks(tokens) * self.chunk_bytes

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "tokens_per_block": self.tokens_per_block, "blocks_per_chunk": self.blocks_per_chunk,
                "tokens_per_chunk": self.tokens_per_chunk, "chunk_bytes": self.chunk_bytes,
                "worker_kv_bytes_per_block": self.pool.worker_kv_bytes_per_block,
                "row_stride": self.row_stride, "fingerprint": self.pool.fingerprint}


def breakeven_gbps(kv_bytes: int, recompute_s: float) -> float:
    """The link rate (GB/s, 1e9 bytes) at which fetching ``kv_bytes`` takes as long as
    recomputing them in ``recompute_s`` seconds."""
    if recompute_s <= 0:
        raise ValueError(f"recompute time must be positive, got {recompute_s}")
    return kv_bytes / recompute_s / 1e9


def speedup(recompute_s: float, hit_s: float) -> float:
    """How many times faster the peer hit is than recomputing (above 1: the hit wins)."""
    return recompute_s / hit_s if hit_s > 0 else float("inf")
