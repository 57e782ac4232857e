"""Write a tiny random Llama checkpoint for engine tests, without downloads.

The weights come from a fixed torch seed, so two calls (in any process) write
byte-identical checkpoints; no tokenizer is written (drive vLLM with
``skip_tokenizer_init=True`` and token-id prompts).

CLI: ``python -m kv_offload_tools.vllm_harness.model DIR [--seed N]``
"""

from __future__ import annotations

import argparse
import json
import os

__all__ = ["TINY_LLAMA_CONFIG", "write_tiny_llama"]

TINY_LLAMA_CONFIG: dict[str, int] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
}


def write_tiny_llama(directory: str, seed: int = 0) -> str:
    """Write the model to ``directory`` (skipped if a complete one is there).

    Returns ``directory``. Imports torch/transformers lazily (vLLM's venv).
    """
    marker = os.path.join(directory, "config.json")
    if os.path.exists(marker) and any(
        f.endswith(".safetensors") for f in os.listdir(directory)
    ):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG, torch_dtype="float32"))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps({"model": write_tiny_llama(args.directory, args.seed)}))


if __name__ == "__main__":
    main()
