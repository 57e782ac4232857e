"""Fetch or recompute: per-peer moving averages against the engine's prefill rate."""

import pytest

from kv_offload_sidecar.peers.fetch_cost import PROBE_EVERY, FetchOrRecompute, PeerSpeeds, PrefillModel

# 16 tokens and 1 MiB a chunk; 1000 tokens/s: recomputing one chunk takes 16 ms.
MODEL = PrefillModel(prefill_tokens_per_second=1000, tokens_per_chunk=16, chunk_bytes=1 << 20)


def test_an_unmeasured_peer_is_worth_trying_and_a_measured_one_is_priced():
    cost = FetchOrRecompute(MODEL)
    assert cost.worth("p", 4)
    cost.speeds.observe_latency("p", 0.002)
    cost.speeds.observe_transfer("p", 1 << 20, 0.010)  # 100 MiB/s: 10 ms a chunk
    assert cost.speeds.estimate("p", 4 << 20) == pytest.approx(0.042)
    assert cost.worth("p", 4)  # 42 ms < 64 ms
    cost.speeds.observe_latency("slow", 0.002)
    cost.speeds.observe_transfer("slow", 1 << 20, 0.020)  # 20 ms a chunk
    assert not cost.worth("slow", 4)  # 82 ms > 64 ms
    assert not cost.worth("p", 0)


def test_moving_averages_follow_a_peer_that_slows_down_by_its_times_not_its_rates():
    speeds = PeerSpeeds(weight=0.5)
    speeds.observe_transfer("p", 1000, 0.001)
    speeds.observe_transfer("p", 1000, 0.004)  # 1 ms, then 4 ms a kB: 2.5 ms a kB, 400 kB/s
    assert speeds.view()["p"]["bytes_per_second"] == pytest.approx(400_000)
    speeds.observe_transfer("p", 1000, 0.00001)  # too short to say anything
    assert speeds.view()["p"]["bytes_per_second"] == pytest.approx(400_000)
    speeds.forget("p")
    assert speeds.estimate("p", 1) is None


def test_a_prefill_rate_of_zero_always_fetches():
    cost = FetchOrRecompute(PrefillModel(0, 16, 1 << 20))
    cost.speeds.observe_latency("p", 10.0)
    assert cost.worth("p", 1)
    with pytest.raises(ValueError, match="prefill_tokens_per_second"):
        PrefillModel(-1, 16, 1)


def test_a_learnt_rate_replaces_the_configured_one():
    cost = FetchOrRecompute(MODEL)
    cost.speeds.observe_latency("p", 0.002)
    cost.speeds.observe_transfer("p", 1 << 20, 0.010)  # 42 ms for 4 chunks
    assert cost.worth("p", 4) and not cost.learnt
    cost.learn_rate(8000)  # 4 chunks of 16 tokens now recompute in 8 ms
    assert cost.learnt and cost.model.prefill_tokens_per_second == 8000
    assert not cost.worth("p", 4)
    cost.learn_rate(0)  # not a rate: ignored
    assert cost.model.prefill_tokens_per_second == 8000


def test_a_fetch_cut_short_by_its_deadline_prices_a_fast_peer_out_at_once():
    cost = FetchOrRecompute(MODEL)
    cost.speeds.observe_latency("p", 0.002)
    for _ in range(20):
        cost.speeds.observe_transfer("p", 1 << 20, 0.001)  # 1 GiB/s for a long while
    assert cost.worth("p", 4)
    # Then one fetch moved half a chunk before its 2 s deadline: ~256 KiB/s.
    cost.speeds.observe_cut_short("p", 512 << 10, 2.0, MODEL.chunk_bytes)
    assert cost.speeds.estimate("p", 4 << 20) > 1.0
    assert not cost.worth("p", 4)


def test_a_deadline_with_nothing_landed_counts_as_less_than_one_chunk_in_that_time():
    speeds = PeerSpeeds()
    speeds.observe_latency("p", 0.001)
    speeds.observe_cut_short("p", 0, 2.0, 1 << 20)
    assert speeds.estimate("p", 4 << 20) == pytest.approx(0.001 + 8.0)


def test_a_priced_out_peer_is_tried_again_once_every_probe_interval():
    cost = FetchOrRecompute(MODEL)
    cost.speeds.observe_latency("slow", 0.002)
    cost.speeds.observe_transfer("slow", 1 << 20, 1.0)
    answers = [cost.worth("slow", 4) for _ in range(3 * PROBE_EVERY)]
    assert answers.count(True) == 3 and answers[PROBE_EVERY - 1] and not answers[PROBE_EVERY - 2]
