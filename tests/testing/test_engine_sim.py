"""The simulated engine: vLLM's row layout, deterministic KV, and byte-for-byte checks."""

import dataclasses
import mmap

import numpy as np
import torch
from kv_offload_testing.engine_sim import (
    RowLayout,
    SimulatedEngine,
    chunk_kv_row,
    trace_tokens,
)
from kv_offload_testing.local_pool import LocalPool, example_config
from kv_offload_testing.prefix_hash import PrefixHasher

CONFIG = example_config()  # bf16, 2 layers, 16-token blocks, 4 blocks per chunk, 16 KiB chunks


def _tp2(config):
    return dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, world_size=2, tp_size=2, is_parallelism_agnostic=False))


def test_row_layout_matches_the_offloading_config():
    layout = RowLayout.from_config(CONFIG)
    assert layout.chunk_bytes == CONFIG.kv_bytes_per_chunk == 16384
    assert layout.row_stride % mmap.PAGESIZE == 0 and layout.row_stride >= layout.chunk_bytes
    tp2 = RowLayout.from_config(_tp2(CONFIG))
    assert tp2.workers == 2 and tp2.chunk_bytes == 2 * tp2.slot_bytes == 32768


def test_kv_is_a_deterministic_function_of_tokens_positions_and_prefix():
    layout = RowLayout.from_config(CONFIG)
    tokens = list(range(100, 164))
    key = b"\x01" * 36
    row = chunk_kv_row(layout, tokens, 0, key)
    assert row.dtype == torch.uint8 and row.numel() == layout.chunk_bytes
    assert torch.equal(row, chunk_kv_row(layout, tokens, 0, key))
    assert not torch.equal(row, chunk_kv_row(layout, tokens[:-1] + [7], 0, key))
    assert not torch.equal(row, chunk_kv_row(layout, tokens, 64, key))
    assert not torch.equal(row, chunk_kv_row(layout, tokens, 0, b"\x02" * 36))


def test_each_worker_slot_holds_its_own_heads_layer_after_layer():
    layout = RowLayout.from_config(_tp2(CONFIG))
    row = chunk_kv_row(layout, list(range(64)), 0, b"\x05" * 36)
    w0, w1 = row[:layout.slot_bytes], row[layout.slot_bytes:]
    assert not torch.equal(w0, w1)
    # Inside a slot: one page per block for layer 0, then layer 1 ([t0 | t1]).
    layer_bytes = layout.blocks_per_chunk * layout.page_bytes
    assert not torch.equal(w0[:layer_bytes], w0[layer_bytes:2 * layer_bytes])
    # Page of block 0, layer 0: K then V of 16 tokens, each token `elems_per_token` bf16 values.
    page = w0[:layout.page_bytes].view(torch.bfloat16).view(2, 16, layout.elems_per_token)
    assert not torch.equal(page[0], page[1])


def test_trace_tokens_equal_hash_prefixes_give_equal_chunk_keys():
    hasher = PrefixHasher(16, 4, seed="0")
    a = hasher.chunk_keys(trace_tokens([1, 2, 3], 64))
    b = hasher.chunk_keys(trace_tokens([1, 2, 4], 64))
    c = hasher.chunk_keys(trace_tokens([5, 2, 3], 64))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)


def test_engine_counts_every_loaded_byte_that_differs_from_its_kv():
    with LocalPool(1, config=CONFIG) as pool:
        engine = SimulatedEngine(CONFIG, hash_seed="0", port=pool[0].port, name="e")
        try:
            tokens = trace_tokens([31, 32, 33], engine.layout.tokens_per_chunk)
            assert engine.run_request(tokens).stored_chunks == 3
            clean = engine.run_request(tokens)
            assert clean.loaded_chunks == 3 and clean.mismatched_bytes == 0
            # Flip every byte of the sidecar's shared-memory store behind its back.
            client = pool.client(0)
            try:
                path = client.info()["store"]["path"]
            finally:
                client.close()
            with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
                data = np.frombuffer(mm, dtype=np.uint8)
                data ^= 0xFF
                del data
            corrupt = engine.run_request(tokens)
            assert corrupt.loaded_chunks == 3
            assert corrupt.mismatched_bytes == 3 * CONFIG.kv_bytes_per_chunk
        finally:
            engine.close()
