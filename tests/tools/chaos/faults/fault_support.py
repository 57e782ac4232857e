"""What the fault tests share: the bench's shape and the invariants every scenario must keep."""

from __future__ import annotations

from kv_offload_tools.chaos.faults.bench import BenchSettings, FaultResult

# A small bench: a hub, two servers, a flood sidecar; 16 KiB chunks.
SETTINGS = BenchSettings(chunk_bytes=16 * 1024, chunks_per_load=32, servers=2, capacity_bytes=16 << 20,
                         flood_capacity_bytes=2 << 20, durable_chunks=16, fetch_deadline_seconds=1.0)


def assert_held(result: FaultResult) -> None:
    """Every fault was survived: nothing corrupt, nothing lost."""
    assert result.injected >= 1, result
    assert result.corrupt_delivered == 0, result
    assert result.lost == 0, result
    assert result.survived == result.injected, result
