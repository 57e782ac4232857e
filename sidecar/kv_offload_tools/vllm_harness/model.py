"""Write a tiny random Llama checkpoint for engine tests, without downloads.

The weights come from a fixed torch seed, so two calls (in any process) write
byte-identical checkpoints; no tokenizer is written (drive vLLM with
``skip_tokenizer_init=True`` and token-id prompts).

CLI: ``python -m kv_offload_tools.vllm_harness.model DIR [--seed N] [--config JSON]``
(``--config``: LlamaConfig fields over ``TINY_LLAMA_CONFIG``, e.g. ``kv_llama_config(32)``).
"""

from __future__ import annotations

import argparse
import json
import os

__all__ = ["TINY_LLAMA_CONFIG", "kv_llama_config", "kv_bytes_per_token", "write_llama",
           "write_tiny_llama"]

TINY_LLAMA_CONFIG: dict[str, int] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
}


def kv_llama_config(num_layers: int = 32) -> dict[str, int]:
    """A random Llama shaped for KV bytes rather than compute (``bench vllm``).

    16 KV heads x head_dim 128 per layer (16 KiB of fp32 KV per token and
    layer; 32 layers: 512 KiB per token, four times Llama-3.1-8B's bf16 128 KiB)
    over a hidden size of 256, so a prefill costs little beside the bytes it makes.
    """
    return {**TINY_LLAMA_CONFIG, "num_hidden_layers": num_layers, "num_attention_heads": 16,
            "num_key_value_heads": 16, "head_dim": 128, "max_position_embeddings": 8192}


def kv_bytes_per_token(config: dict[str, int], dtype_bytes: int = 4) -> int:
    """Bytes of K and V one token occupies in every layer of a Llama ``config``."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def write_tiny_llama(directory: str, seed: int = 0) -> str:
    """Write the model to ``directory`` (skipped if a complete one is there).

    Returns ``directory``. Imports torch/transformers lazily (vLLM's venv).
    """
    return write_llama(directory, TINY_LLAMA_CONFIG, seed)


def write_llama(directory: str, config: dict[str, int], seed: int = 0) -> str:
    """Write a random Llama of ``config`` (LlamaConfig fields) to ``directory``
    (skipped if a complete one is there); same seed and config, same bytes."""
    marker = os.path.join(directory, "config.json")
    if os.path.exists(marker) and any(
        f.endswith(".safetensors") for f in os.listdir(directory)
    ):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32"))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="{}",
                        help="LlamaConfig fields as JSON, over the tiny model's")
    args = parser.parse_args()
    config = {**TINY_LLAMA_CONFIG, **json.loads(args.config)}
    print(json.dumps({"model": write_llama(args.directory, config, args.seed)}))


if __name__ == "__main__":
    main()
