"""A failing peer's link backs off exponentially with full jitter, so the pods of a pool do not
all re-handshake a restarted peer at the same instants."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kv_offload_sidecar.data.base import TransportError
from kv_offload_sidecar.peers.liveness import (
    ANSWER_FLOOR_SECONDS,
    HEAL_BACKOFF_MAX_SECONDS,
    LOST_AFTER_SECONDS,
    MEMBER_PROBE_SECONDS,
    MEMBER_PROBES_PER_SECOND,
    AnswerGivenUp,
    RoundTrips,
    answer_or_silence,
    last_heard,
    pong,
    probe_period,
)
from kv_offload_sidecar.peers.links import PeerLink, backoff_cap, backoff_delay


def test_the_delay_is_drawn_between_zero_and_the_doubling_cap():
    assert backoff_delay(1, 0.5, 30.0, draw=lambda: 0.999) < 0.5
    assert backoff_delay(3, 0.5, 30.0, draw=lambda: 0.5) == 1.0  # half of 0.5 * 2**2
    assert backoff_delay(20, 0.5, 30.0, draw=lambda: 0.5) == 15.0  # half of the cap
    assert backoff_delay(3, 0.5, 30.0, draw=lambda: 0.0) == 0.0


def test_pods_failing_together_retry_spread_over_the_window():
    rng = random.Random(42)
    delays = [backoff_delay(4, 0.5, 30.0, draw=rng.random) for _ in range(1000)]  # cap 4 s
    assert 0.0 <= min(delays) < 0.1 and 3.9 < max(delays) < 4.0
    assert len(set(delays)) == 1000
    assert 1.8 < sum(delays) / len(delays) < 2.2


def test_a_lost_or_unreachable_peer_is_retried_within_the_heal_cap_and_a_rejecting_one_backs_off_further():
    assert backoff_cap("backoff", 30.0) == HEAL_BACKOFF_MAX_SECONDS <= 2.0
    assert backoff_cap("rejected", 30.0) == 30.0
    assert backoff_delay(20, 0.5, backoff_cap("backoff", 30.0), draw=lambda: 0.999) < 2.0


def test_the_answer_silence_follows_the_measured_round_trips_between_the_floor_and_the_deadline():
    rtt = RoundTrips()
    assert rtt.answer_silence(2.0) == 2.0  # no sample yet: the whole deadline
    for _ in range(20):
        rtt.observe(0.001)
    assert rtt.answer_silence(2.0) == ANSWER_FLOOR_SECONDS  # a small round trip: the floor
    for _ in range(20):
        rtt.observe(0.2)
    assert 0.4 < rtt.answer_silence(2.0) < 2.0  # 2 x (srtt + 4 rttvar): follows a slow peer
    for _ in range(5):
        rtt.observe(3.0)
    assert rtt.answer_silence(2.0) == 2.0  # never past the deadline


def test_an_unanswered_wait_says_whether_the_peer_fell_silent_or_its_deadline_passed():
    async def wait(heard, within: float) -> str:
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(AnswerGivenUp) as gave_up:
            await answer_or_silence(never, heard, silence=0.05, within=within)
        return gave_up.value.reason

    assert asyncio.run(wait(float, within=10.0)) == "silence"  # nothing heard since the call
    assert asyncio.run(wait(time.monotonic, within=0.2)) == "deadline"  # heard all along


def test_a_peer_asked_earlier_and_not_heard_from_since_gets_no_fresh_silence_and_one_heard_waits_on():
    # A request that already asked the peer (its owner question) counts the silence from there.
    async def waited(heard_ago: float) -> tuple[str, float]:
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.2, fut.set_result, "answer")
        now = time.monotonic()
        try:
            got = await answer_or_silence(fut, lambda: now - heard_ago, silence=5.0, since=now - 6.0)
        except AnswerGivenUp as gave_up:
            got = gave_up.reason
        return got, time.monotonic() - now

    silent, took = asyncio.run(waited(heard_ago=7.0))  # nothing since it was asked 6 s ago
    assert silent == "silence" and took < 5.0  # not a fresh 5 s silence from this call
    assert asyncio.run(waited(heard_ago=0.0))[0] == "answer"  # heard since: waits for the answer
    # Heard after the earlier question (its ping's pong), if longer ago than a silence: alive,
    # so this question gets its own silence.
    assert asyncio.run(waited(heard_ago=5.5))[0] == "answer"


def test_a_ping_beside_a_question_is_a_round_trip_sample_and_a_silent_one_raises_nothing():
    class Client:
        def __init__(self, answer: float | Exception) -> None:
            self.answer, self.silence = answer, None

        async def ping(self, silence: float) -> float:
            self.silence = silence
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    answered, silent, rtt = Client(0.004), Client(TransportError("peer silent")), RoundTrips()
    asyncio.run(pong(answered, rtt))
    assert rtt.srtt == 0.004 and answered.silence == LOST_AFTER_SECONDS  # a heartbeat's bound
    asyncio.run(pong(silent, rtt))  # the connection failed: the link's watch finds it closed
    assert rtt.srtt == 0.004


def test_an_opening_data_link_counts_as_hearing_the_peer_only_once_it_reached_the_holders_host():
    async def heard() -> list[float]:
        link = PeerLink("10.0.0.2:5710")
        seen = [last_heard(link)]  # no data link, none opening
        link.opening = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
        seen.append(last_heard(link))  # opening, its TCP connection not made (a host cut off)
        link.open_reached = True
        before = time.monotonic()
        seen.append(last_heard(link) - before)  # reached: the open's own bound judges the peer
        return seen

    never, not_reached, reached = asyncio.run(heard())
    assert never == 0.0 and not_reached == 0.0
    assert reached >= 0.0


def test_quiet_members_are_probed_within_a_rate_that_does_not_grow_with_the_pool():
    assert probe_period(3) == MEMBER_PROBE_SECONDS  # a small pool: each quiet member every 5 s
    for others in (1, 3, 20, 21, 31, 255, 1023):
        assert others / probe_period(others) <= MEMBER_PROBES_PER_SECOND
    assert probe_period(1023) == 1023 / MEMBER_PROBES_PER_SECOND  # a gone idle member: minutes at 1,024 pods
