"""Bytes of a holder's store slots flipped while the hub loads them: refused by checksum, never
delivered, nothing lost once they are flipped back.

``kv-offload bench chaos --transport nixl`` runs this against one-sided READs (its test is in
tests/tools/bench/test_bench_chaos.py, in a process of its own: NIXL agents live per process);
here it runs on the module's tcp bench, whose holder streams the damaged slot instead.
"""

from __future__ import annotations

from fault_support import assert_held
from kv_offload_tools.chaos.chunks import chunk_content, chunk_keys, store_chunks
from kv_offload_tools.chaos.faults.bench import ChaosBench
from kv_offload_tools.chaos.faults.slot_faults import HolderSlots, slot_flip


def test_holder_slots_finds_chunks_by_content_and_a_second_flip_restores(bench: ChaosBench) -> None:
    name = bench.server_names[0]
    keys = chunk_keys("holder-slots", 4)
    assert store_chunks(bench.engine(name), keys, bench.s.chunk_bytes) == 4
    with HolderSlots(bench.pool[name]) as holder:
        where = holder.locate(keys)
        assert sorted(where) == sorted(keys) and len(set(where.values())) == 4
        slot = where[keys[2]]
        holder.flip(slot, 5)
        assert holder.slot(slot) != chunk_content(keys[2], bench.s.chunk_bytes)
        assert keys[2] not in holder.locate(keys)
        holder.flip(slot, 5)
        assert holder.slot(slot) == chunk_content(keys[2], bench.s.chunk_bytes)


def test_flipped_slot_bytes_are_refused_by_checksum_and_load_back_once_restored(bench: ChaosBench) -> None:
    result = slot_flip(bench, 2)
    assert_held(result)
    assert result.integrity_rejected >= 1, result  # the first round flips before the load is submitted
    assert result.loads_missed >= 1, result
