"""Recompute: how long the device takes to prefill a prompt (`bench gpu`'s reference).

A model of the config's shape with random weights (``transformers``, no hub access), SDPA
attention, batch 1, ``logits_to_keep=1``: bf16 on a GPU, float32 on a CPU (bf16 matmuls
are slow there; the CPU run is a small-size check of the code, not a measurement). Each
prompt length is timed after one warm-up as the median of ``repeats`` runs, with the device
synchronized around each (``torch.cuda.synchronize``), as ``shared/gpu/prefill_h200.py``
measured the issue's H200 figures.

A model whose weights would take more than ``WEIGHT_SHARE`` of the GPU's memory (Llama-3.1-70B
on one H200) is timed on its first ``SLICE_LAYERS`` layers and the time scaled by
``layers / SLICE_LAYERS``: its one-GPU equivalent (a TP8 pod divides that time by up to 8).
A length that fails (out of memory) is reported with its error; the others go on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Most of the GPU's memory a model's weights may take before it is timed on a layer slice.
WEIGHT_SHARE = 0.5
# Layers a sliced model is timed on (the 70B figures: 8 of 80 layers, times 10).
SLICE_LAYERS = 8


def device() -> str:
    """"cuda" when a GPU is there, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def weight_bytes(model_config: Mapping[str, Any], layers: int | None = None, dtype_bytes: int = 2) -> int:
    """Bytes of a Llama-shaped model's weights (``layers`` of them; all by default)."""
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    inter = int(model_config["intermediate_size"])
    vocab = int(model_config["vocab_size"])
    n = int(model_config["num_hidden_layers"]) if layers is None else layers
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if model_config.get("tie_word_embeddings") else 2)
    return (embeddings + n * per_layer + hidden) * dtype_bytes


def layers_to_time(model_config: Mapping[str, Any], memory_bytes: int | None) -> int:
    """Layers timed: all of them, or ``SLICE_LAYERS`` when the weights would take more than
    ``WEIGHT_SHARE`` of ``memory_bytes`` (None: no limit, the CPU)."""
    layers = int(model_config["num_hidden_layers"])
    if memory_bytes is None or weight_bytes(model_config) <= WEIGHT_SHARE * memory_bytes:
        return layers
    return min(layers, SLICE_LAYERS)


@dataclass(frozen=True)
class PrefillResult:
    """The recompute time of one prompt length."""

    # Prompt tokens.
    tokens: int
    # Seconds of the whole model's prefill (the slice's, scaled), None when it failed.
    seconds: float | None
    # Layers actually run (fewer than the model's when sliced).
    layers_timed: int
    # Factor the slice's time was multiplied by (1.0 when not sliced).
    layer_scale: float
    # Each timed run's seconds (scaled), for the spread.
    runs: tuple[float, ...] = ()
    # Why it failed ("" when it did not).
    error: str = ""


def _build(model_config: Mapping[str, Any], layers: int, dev: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in model_config.items()
              if k not in ("architectures", "transformers_version", "torch_dtype", "dtype")}
    fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**fields)
    config._attn_implementation = "sdpa"
    with torch.device(dev):  # made on the device in float32, then cast (as prefill_h200.py did)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()


def _sync(dev: str) -> None:
    if dev == "cuda":
        import torch

        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], dev: str, repeats: int) -> list[float]:
    fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def measure_prefill(model_config: Mapping[str, Any], lengths: Sequence[int], *, repeats: int = 3,
                    progress: Callable[[str], None] = lambda line: None) -> list[PrefillResult]:
    """Recompute time of each prompt length on this machine's device."""
    import torch

    dev = device()
    memory = torch.cuda.get_device_properties(0).total_memory if dev == "cuda" else None
    layers = layers_to_time(model_config, memory)
    scale = int(model_config["num_hidden_layers"]) / layers
    progress(f"building a random-weight model: {layers} of {model_config['num_hidden_layers']} layers "
             f"on {dev}" + (f", times x{scale:g}" if scale != 1 else ""))
    model = _build(model_config, layers, dev)
    vocab = int(model_config["vocab_size"])
    results = []
    try:
        for n in lengths:
            ids = torch.randint(0, vocab, (1, n), device=dev)
            try:
                with torch.inference_mode():
                    runs = _timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), dev, repeats)
            except (RuntimeError, MemoryError) as exc:  # out of memory at the longest prompt: go on
                results.append(PrefillResult(n, None, layers, scale, error=repr(exc)[:300]))
                progress(f"prefill {n} tokens failed: {repr(exc)[:200]}")
                if dev == "cuda":
                    torch.cuda.empty_cache()
                continue
            finally:
                ids = None  # the prompt's memory goes before the next length's
            scaled = tuple(t * scale for t in runs)
            results.append(PrefillResult(n, statistics.median(scaled), layers, scale, scaled))
            progress(f"prefill {n:>6} tokens: {statistics.median(scaled) * 1e3:9.1f} ms")
    finally:
        model = None  # the weights' memory goes before the cache is emptied
        if dev == "cuda":
            torch.cuda.empty_cache()
    return results
