"""Each fault class against real sidecar processes: nothing corrupt, nothing lost, the pool recovers.

One small ChaosBench (a hub, two servers, a flood sidecar) is shared by the
module; every test injects one fault class a few times and checks the
scenario's own accounting, which compares every delivered chunk byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_tools.bench.chaos_faults import BenchSettings, ChaosBench, FaultResult

SETTINGS = BenchSettings(chunk_bytes=16 * 1024, chunks_per_load=32, servers=2, capacity_bytes=16 << 20,
                         flood_capacity_bytes=2 << 20, durable_chunks=16, fetch_deadline_seconds=1.0)


@pytest.fixture(scope="module")
def bench() -> Iterator[ChaosBench]:
    b = ChaosBench(SETTINGS)
    try:
        b.start()
        yield b
    finally:
        b.close()


def _held(result: FaultResult) -> None:
    assert result.injected >= 1, result
    assert result.corrupt_delivered == 0, result
    assert result.lost == 0, result
    assert result.survived == result.injected, result


def test_sigkill_at_a_byte_of_a_fetch_gives_a_miss_and_no_partial_chunk(bench: ChaosBench) -> None:
    result = bench.sigkill_on_wire(2)
    _held(result)
    assert result.in_flight == 2  # both kills cut a fetch short
    assert result.loads_missed == 2


def test_sigkill_of_a_serving_peer_during_engine_loads_delivers_no_corrupt_chunk(bench: ChaosBench) -> None:
    result = bench.sigkill_mid_fetch(kills=1, seconds=15)
    _held(result)


def test_sigstop_past_the_deadline_turns_the_load_into_a_miss_and_recovers(bench: ChaosBench) -> None:
    result = bench.sigstop_past_deadline(1)
    _held(result)
    assert result.loads_missed == 1
    assert 0 < result.worst_give_up_seconds


def test_flipped_bytes_are_refused_by_checksum_never_delivered(bench: ChaosBench) -> None:
    result = bench.wire_faults("flip", 4)
    _held(result)
    assert result.loads_missed == 4
    assert result.integrity_rejected >= 1  # most flips land in chunk bytes


def test_truncated_fetches_leave_no_partial_chunk(bench: ChaosBench) -> None:
    result = bench.wire_faults("truncate", 4)
    _held(result)
    assert result.loads_missed == 4


def test_a_slow_link_gives_up_at_the_deadline(bench: ChaosBench) -> None:
    result = bench.wire_faults("delay", 1)
    _held(result)
    assert result.loads_missed == 1
    assert result.worst_give_up_seconds >= SETTINGS.fetch_deadline_seconds * 0.9


def test_reconnect_storm_recovers_every_peer(bench: ChaosBench) -> None:
    _held(bench.reconnect_storm(1, probes=8))


def test_peer_leaving_and_rejoining_discovery_serves_again(bench: ChaosBench) -> None:
    result = bench.discovery_churn(1)
    _held(result)
    assert result.loads_missed == 1  # its chunks are misses while it is away


def test_writes_at_ten_times_the_budget_never_exceed_it(bench: ChaosBench) -> None:
    result = bench.write_flood(10)
    _held(result)
    assert 0 < result.store_peak_bytes <= result.store_budget_bytes
    assert result.injected >= 10


def test_sidecar_restart_under_a_running_engine_delivers_no_corrupt_chunk(bench: ChaosBench) -> None:
    # Known failure (reported): EngineClient keeps the old store file mapped after its
    # sidecar restarts, so what it stores afterwards reaches peers with wrong bytes.
    _held(bench.restart_under_engine(1))
