"""Sizing of `bench vllm`: the model, the prompts, and the memory every engine and sidecar gets.

Everything is sized to what the largest prefix needs, because the host's RAM is
shared: vLLM's KV cache (``kv_cache_memory_bytes``; the engine driver then unsets
the whole-GiB ``VLLM_CPU_KVCACHE_SPACE``) holds the largest prompt, or the
inter-token run's traffic prompt beside its decoding request;
vLLM's primary CPU tier (``cpu_bytes_to_use``) and each sidecar's store hold
the largest prefix plus a few chunks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kv_offload_tools.vllm_harness.model import kv_bytes_per_token, kv_llama_config

GiB = 1 << 30
MiB = 1 << 20

# Tokens per offloaded chunk (vLLM's offloading block_size) and per vLLM KV block.
CHUNK_TOKENS = 64
BLOCK_TOKENS = 32
# Tokens after the shared prefix in every prompt: the part a hit still computes.
SUFFIX_TOKENS = 1
# Prompt tokens of the decoding request of the inter-token measurement.
DECODE_PROMPT_TOKENS = 32
# Token ids of the random prompts (the model's vocabulary is 2048; low ids avoided).
_TOKEN_RANGE = (10, 2000)
# Chunks of slack in vLLM's primary tier and in each sidecar's store.
_SLACK_CHUNKS = 4
# Traffic windows behind each inter-token figure (load, store, and the reference engines'
# prefill), each beside a fresh prefix: a window holds 10-25 intervals, so its p99 is about
# its slowest step, and the figure is the median of the windows' p99s.
WINDOW_RUNS = 3
# Hits behind each TTFT figure of a sidecar hit and of its CPU-tier reference, taken in turns
# (``vllm_ttft_figures.median_hit``): one TTFT is one request, and the own-sidecar target's
# margin (half a memcpy) is what two runs of one hit differ by here.
HIT_RUNS = 3


@dataclass(frozen=True)
class Plan:
    """What one run measures and how big everything is."""

    # Prefix sizes in MiB of KV, ascending.
    sizes_mib: tuple[int, ...]
    # Data planes (the sidecar's --transport), in run order.
    planes: tuple[str, ...]
    # Model layers: 16 KiB of fp32 KV per token and layer.
    layers: int
    # Prefix size of the inter-token measurement (MiB of KV); 0 skips it.
    itl_size_mib: int
    # Most tokens the decoding request may produce in one inter-token run.
    max_decode_tokens: int

    @property
    def model_config(self) -> dict[str, int]:
        return kv_llama_config(self.layers)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config)

    @property
    def chunk_bytes(self) -> int:
        return CHUNK_TOKENS * self.bytes_per_token

    def prefix_tokens(self, size_mib: int) -> int:
        """Tokens of a prefix of ``size_mib`` MiB of KV, whole chunks (at least one)."""
        chunks = max(1, math.ceil(size_mib * MiB / self.chunk_bytes))
        return chunks * CHUNK_TOKENS

    def prefix_bytes(self, size_mib: int) -> int:
        return self.prefix_tokens(size_mib) * self.bytes_per_token

    @property
    def largest_prompt_tokens(self) -> int:
        sizes = (*self.sizes_mib, self.itl_size_mib)
        return max(self.prefix_tokens(s) for s in sizes if s) + SUFFIX_TOKENS

    @property
    def max_model_len(self) -> int:
        """The largest prompt, or the decoding request when the inter-token run is made (its KV
        cache, ``kv_cache_bytes``, holds no decoding request otherwise: vLLM refuses to start an
        engine whose cache cannot hold one request of ``max_model_len``)."""
        decoding = DECODE_PROMPT_TOKENS + self.max_decode_tokens if self.itl_size_mib else 0
        return max(self.largest_prompt_tokens + 1, decoding)

    @property
    def kv_cache_bytes(self) -> int:
        """vLLM's KV cache (``kv_cache_memory_bytes``): the largest prompt, or the inter-token
        run's traffic prompt beside its decoding request, with a few blocks of slack."""
        tokens = self.largest_prompt_tokens + 1
        if self.itl_size_mib:
            tokens = max(tokens, self.prefix_tokens(self.itl_size_mib) + SUFFIX_TOKENS + 1
                         + DECODE_PROMPT_TOKENS + self.max_decode_tokens)
        blocks = math.ceil(tokens / BLOCK_TOKENS) + _SLACK_CHUNKS
        return blocks * BLOCK_TOKENS * self.bytes_per_token

    @property
    def primary_bytes(self) -> int:
        """vLLM's primary CPU tier (``cpu_bytes_to_use``): the largest prefix and some slack."""
        return (self.largest_prompt_tokens // CHUNK_TOKENS + _SLACK_CHUNKS) * self.chunk_bytes

    @property
    def store_bytes(self) -> int:
        """Each sidecar's store capacity: the largest prefix and some slack."""
        return (self.largest_prompt_tokens // CHUNK_TOKENS + _SLACK_CHUNKS) * self.chunk_bytes

    def llm_kwargs(self) -> dict[str, int]:
        # One step prefills a whole prompt (the inter-token run excludes that one step).
        return {"max_model_len": self.max_model_len,
                "max_num_batched_tokens": max(self.max_model_len, 2048),
                "kv_cache_memory_bytes": self.kv_cache_bytes}


def prompt(seed: str, tokens: int) -> list[int]:
    """Deterministic random token ids; a distinct seed shares no chunk with another."""
    rng = random.Random(seed)
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(tokens)]


def prompt_key(size_mib: int, role: str = "prefix") -> str:
    """The key of a prompt in the baseline's first tokens."""
    return f"{role}/{size_mib}"


def itl_role(what: str, run: int) -> str:
    """The role of the traffic prompt of one inter-token window (``what``: load, store,
    reference): each window's prefix is fresh."""
    return f"itl-{what}-{run}"


def prefix_prompt(plan: Plan, size_mib: int, role: str = "prefix") -> list[int]:
    """The prompt of one measurement: a prefix of ``size_mib`` and ``SUFFIX_TOKENS`` more.

    Every plane runs fresh engines and sidecars, so the planes share prompts (and
    the baseline computes each once); roles within a plane share no chunk."""
    return prompt(prompt_key(size_mib, role), plan.prefix_tokens(size_mib) + SUFFIX_TOKENS)


def decode_prompt(which: str) -> list[int]:
    return prompt(f"decode/{which}", DECODE_PROMPT_TOKENS)
