"""Damaged bytes, kills at a byte and reconnect storms on the wire: no partial or corrupt chunk, ever.

A hand-driven peer fetches from the module's ChaosBench through ``FaultProxy``;
every chunk that becomes visible in its store is compared byte for byte.
"""

from __future__ import annotations

from fault_support import assert_held
from kv_offload_tools.chaos.faults.bench import ChaosBench
from kv_offload_tools.chaos.faults.wire_faults import (
    damaged_wire,
    reconnect_storm,
    sigkill_on_wire,
)


def test_sigkill_at_a_byte_of_a_fetch_gives_a_miss_and_no_partial_chunk(bench: ChaosBench) -> None:
    result = sigkill_on_wire(bench, 2)
    assert_held(result)
    assert result.in_flight == 2  # both kills cut a fetch short
    assert result.loads_missed == 2


def test_flipped_bytes_are_refused_by_checksum_never_delivered(bench: ChaosBench) -> None:
    result = damaged_wire(bench, "flip", 4)
    assert_held(result)
    assert result.loads_missed == 4
    assert result.integrity_rejected >= 1  # most flips land in chunk bytes


def test_truncated_fetches_leave_no_partial_chunk(bench: ChaosBench) -> None:
    result = damaged_wire(bench, "truncate", 4)
    assert_held(result)
    assert result.loads_missed == 4


def test_a_slow_link_gives_up_at_the_deadline(bench: ChaosBench) -> None:
    result = damaged_wire(bench, "delay", 1)
    assert_held(result)
    assert result.loads_missed == 1
    assert result.deadline_give_ups == 1  # the client counted its fetch as ended by the deadline


def test_reconnect_storm_recovers_every_peer(bench: ChaosBench) -> None:
    assert_held(reconnect_storm(bench, 1, probes=8))
