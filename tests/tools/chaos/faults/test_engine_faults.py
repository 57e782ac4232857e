"""Signals, restarts and a write flood under the engines: nothing corrupt, nothing lost, the pool recovers.

Every test injects one fault class a few times into the module's ChaosBench and
checks the scenario's own accounting, which compares every delivered chunk
byte for byte.
"""

from __future__ import annotations

from fault_support import assert_held
from kv_offload_tools.chaos.faults.bench import ChaosBench
from kv_offload_tools.chaos.faults.engine_faults import (
    leave_and_rejoin,
    restart_under_engine,
    sigkill_mid_fetch,
    sigstop_past_deadline,
    write_flood,
)


def test_sigkill_of_a_serving_peer_during_engine_loads_delivers_no_corrupt_chunk(bench: ChaosBench) -> None:
    assert_held(sigkill_mid_fetch(bench, kills=1, seconds=15))


def test_sigstop_past_the_deadline_turns_the_load_into_a_miss_at_the_deadline_and_recovers(
        bench: ChaosBench) -> None:
    result = sigstop_past_deadline(bench, 1)
    assert_held(result)
    assert result.loads_missed == 1
    assert result.deadline_give_ups == 1  # the hub's sidecar answered the miss itself, by its deadline


def test_peer_leaving_and_rejoining_serves_again(bench: ChaosBench) -> None:
    result = leave_and_rejoin(bench, 1)
    assert_held(result)
    assert result.loads_missed == 1  # its chunks are misses while it is away


def test_writes_at_ten_times_the_budget_never_exceed_it(bench: ChaosBench) -> None:
    result = write_flood(bench, 10)
    assert_held(result)
    assert 0 < result.store_peak_bytes <= result.store_budget_bytes
    assert result.injected >= 10


def test_sidecar_restart_under_a_running_engine_delivers_no_corrupt_chunk(bench: ChaosBench) -> None:
    assert_held(restart_under_engine(bench, 1))
