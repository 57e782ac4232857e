"""What a data connection may cost before its proof (data.before_auth): its places among
the unauthenticated connections, and the memory handed back after strangers."""

from __future__ import annotations

import gc

from kv_offload_sidecar.data.before_auth import (
    MAX_UNAUTHENTICATED_CONNECTIONS,
    MAX_UNAUTHENTICATED_PER_SOURCE,
    TRIM_AFTER_STRANGERS,
    TRUSTED_SOURCE_SECONDS,
    TrustedSources,
    UnauthenticatedLimit,
    freeze_long_lived,
    thaw_long_lived,
)
from waiting import wait_for_async


def test_places_are_limited_per_source_and_in_all_and_given_back() -> None:
    limit = UnauthenticatedLimit(per_source=2, total=3)
    assert limit.admit("a") is None and limit.admit("a") is None
    assert "from one address" in (limit.admit("a") or "")
    assert limit.admit("b") is None
    assert "from all sources" in (limit.admit("c") or "")
    assert limit.count == 3
    limit.leave("a", proved=True)
    assert limit.admit("c") is None  # a place in all, and "a" may open one again later
    limit.leave("c", proved=False)
    assert limit.admit("a") is None
    for source in ("a", "a", "b"):
        limit.leave(source, proved=False)
    assert limit.count == 0


def test_a_source_that_proved_a_session_is_not_refused_while_strangers_fill_the_places() -> None:
    limit = UnauthenticatedLimit(per_source=1, total=2)
    assert limit.admit("member") is None
    limit.leave("member", proved=True)
    assert limit.admit("a") is None and limit.admit("b") is None
    assert limit.admit("c") is not None
    assert limit.admit("member") is None and limit.admit("member") is None  # past both limits
    assert limit.count == 4
    for source in ("a", "b", "member", "member"):
        limit.leave(source, proved=False)
    assert limit.count == 0


def test_trust_lapses_after_its_seconds_and_is_shared_by_whoever_holds_the_set() -> None:
    now = [0.0]
    trusted = TrustedSources(clock=lambda: now[0])
    limit = UnauthenticatedLimit(per_source=1, total=1, trusted=trusted)
    trusted.proved("member")  # e.g. its handshake on the control port
    assert limit.admit("member") is None and limit.admit("member") is None
    now[0] = TRUSTED_SOURCE_SECONDS
    assert "member" not in trusted
    assert limit.admit("member") is not None


def test_the_defaults_leave_room_for_a_peer_and_its_lanes() -> None:
    assert 2 <= MAX_UNAUTHENTICATED_PER_SOURCE < MAX_UNAUTHENTICATED_CONNECTIONS


async def test_memory_is_handed_back_once_a_crowd_of_strangers_left_and_not_for_proved_peers() -> None:
    limit = UnauthenticatedLimit()
    for _ in range(TRIM_AFTER_STRANGERS):  # peers that proved themselves: nothing to hand back
        assert limit.admit("peer") is None
        limit.leave("peer", proved=True)
    for i in range(TRIM_AFTER_STRANGERS):
        assert limit.admit(f"10.0.0.{i}") is None
    for i in range(TRIM_AFTER_STRANGERS):
        limit.leave(f"10.0.0.{i}", proved=False)
    assert limit.trims == 0  # a moment later: their transports free their buffers first
    await wait_for_async("the strangers' memory handed back", lambda: limit.trims)
    assert limit.trims == 1


def test_what_lives_when_the_sidecar_is_up_is_frozen_out_of_later_collections() -> None:
    try:
        freeze_long_lived()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules, at least
        later = [[] for _ in range(100)]
        assert gc.get_freeze_count() == frozen and all(gc.is_tracked(x) for x in later)
    finally:
        thaw_long_lived()
    assert gc.get_freeze_count() == 0
