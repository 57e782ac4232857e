"""`bench vllm`'s sizing (``plan.Plan``): every engine's KV cache holds one request of its
``max_model_len``, which vLLM checks before it starts an engine."""

from __future__ import annotations

import pytest

from kv_offload_tools.bench.vllm_ttft.plan import BLOCK_TOKENS, Plan


@pytest.mark.parametrize("itl_size_mib", [0, 64])
@pytest.mark.parametrize("sizes_mib", [(8,), (64,), (128, 512, 1024)])
def test_the_kv_cache_holds_a_request_of_the_longest_length_the_engine_admits(
        sizes_mib: tuple[int, ...], itl_size_mib: int) -> None:
    plan = Plan(sizes_mib, ("tcp",), layers=32, itl_size_mib=itl_size_mib, max_decode_tokens=768)
    blocks_needed = -(-plan.max_model_len // BLOCK_TOKENS)
    assert plan.kv_cache_bytes >= blocks_needed * BLOCK_TOKENS * plan.bytes_per_token
    assert plan.max_model_len > plan.largest_prompt_tokens
