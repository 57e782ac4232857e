"""What a data connection may cost before its proof (data.before_auth): its places among
the unauthenticated connections, and the memory handed back after strangers."""

from __future__ import annotations

import gc

from kv_offload_sidecar.data.before_auth import (
    MAX_UNPROVEN_CONNECTIONS,
    MAX_UNPROVEN_PER_SOURCE,
    TRIM_AFTER_STRANGERS,
    TRUSTED_SOURCE_SECONDS,
    Place,
    StrangerLimit,
    TrustedSources,
    freeze_long_lived,
    thaw_long_lived,
)
from waiting import wait_for_async


def limited(per_source: int, total: int, trusted: TrustedSources | None = None) -> StrangerLimit:
    limit = StrangerLimit(trusted)
    limit.per_source, limit.total = per_source, total
    return limit


def test_places_are_limited_per_source_and_in_all_and_given_back() -> None:
    limit = limited(2, 3)
    a1, a2 = limit.admit("a"), limit.admit("a")
    assert isinstance(a1, Place) and isinstance(a2, Place)
    assert "from this address (2)" in limit.admit("a")  # type: ignore[operator]
    b = limit.admit("b")
    assert "from all sources (3)" in limit.admit("c")  # type: ignore[operator]  # none can be closed
    assert limit.count == 3
    limit.leave(a1, proved=True)
    c = limit.admit("c")  # a place in all, and "a" is trusted from now on
    limit.leave(c, proved=False)
    limit.leave(c, proved=False)  # again: nothing
    for place in (a2, b):
        limit.leave(place, proved=False)
    assert limit.count == 0


def test_a_newcomer_takes_the_place_of_the_largest_holders_oldest_connection() -> None:
    limit = limited(3, 4)
    closed: list[tuple[str, str]] = []
    places = [limit.admit(s) for s in ("a", "a", "a", "b")]
    for place in places:
        place.evict = lambda why, place=place: closed.append((place.source, why))  # type: ignore[union-attr]
    assert isinstance(limit.admit("c"), Place)
    assert closed == [("a", "its oldest unauthenticated connection closed for a newcomer (4 were open)")]
    assert limit.count == 4
    # "b" would then hold as many as "a" with one more: no room is made for it.
    assert isinstance(limit.admit("b"), str) and len(closed) == 1
    limit.leave(places[0], proved=False)  # the evicted one's own end: nothing more
    assert limit.count == 4


def test_a_source_that_proved_itself_is_not_held_to_the_limits_while_strangers_fill_them() -> None:
    limit = limited(1, 2)
    limit.leave(limit.admit("member"), proved=True)  # type: ignore[arg-type]
    assert isinstance(limit.admit("a"), Place) and isinstance(limit.admit("b"), Place)
    assert isinstance(limit.admit("c"), str)
    member = [limit.admit("member"), limit.admit("member")]  # past both limits
    assert all(isinstance(p, Place) and not p.counted for p in member)
    assert limit.count == 2


def test_trust_lapses_after_its_seconds_and_is_shared_by_whoever_holds_the_set() -> None:
    now = [0.0]
    trusted = TrustedSources(clock=lambda: now[0])
    limit = limited(1, 1, trusted)
    trusted.proved("member")  # e.g. its handshake on the control port
    assert isinstance(limit.admit("member"), Place) and isinstance(limit.admit("member"), Place)
    now[0] = TRUSTED_SOURCE_SECONDS
    assert "member" not in trusted
    assert isinstance(limit.admit("member"), Place)
    assert isinstance(limit.admit("member"), str)


def test_one_set_of_limits_leaves_room_for_a_peer_its_dp_ports_and_lanes() -> None:
    assert 8 <= MAX_UNPROVEN_PER_SOURCE < MAX_UNPROVEN_CONNECTIONS


async def test_memory_is_handed_back_once_a_crowd_of_strangers_left_and_not_for_proved_peers() -> None:
    limit = StrangerLimit()
    for _ in range(TRIM_AFTER_STRANGERS):  # peers that proved themselves: nothing to hand back
        limit.leave(limit.admit("peer"), proved=True)  # type: ignore[arg-type]
    strangers = [limit.admit(f"10.0.0.{i}") for i in range(TRIM_AFTER_STRANGERS)]
    for place in strangers:
        limit.leave(place, proved=False)  # type: ignore[arg-type]
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
