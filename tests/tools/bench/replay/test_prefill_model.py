"""The replay's prefill model: prefill seconds saved with every peer run fetched, or decided."""

import pytest

from kv_offload_tools.bench.replay.prefill_model import PrefillSettings, prefill_savings

# 512 tokens x 128 KiB = 64 MiB a chunk; at 10k tokens/s a chunk prefills in 51.2 ms.
MODEL = PrefillSettings(tokens_per_second=10_000, tokens_per_chunk=512, kv_bytes_per_token=131_072,
                        links=(1.25e9, 25e9), latency_seconds=0.0005)
# (local, peer, asked) per request.
OUTCOMES = [(0, 0, 4), (2, 3, 6), (0, 5, 5)]


def test_a_slow_link_recomputes_peer_runs_and_a_fast_one_fetches_them():
    slow, fast = prefill_savings(MODEL, OUTCOMES)
    per_chunk = 512 / 10_000
    assert slow["prefill_seconds_without_offload"] == pytest.approx(15 * per_chunk)
    # 10 GbE: 64 MiB take 53.7 ms, longer than 51.2 ms of prefill: both peer runs are recomputed.
    assert (slow["peer_runs_fetched"], slow["peer_runs_recomputed"]) == (0, 2)
    fetch = lambda n, link: 0.0005 + n * MODEL.chunk_bytes / link  # noqa: E731
    assert slow["prefill_seconds_always_fetch"] == pytest.approx(
        4 * per_chunk + per_chunk + fetch(3, 1.25e9) + fetch(5, 1.25e9))
    assert slow["prefill_seconds_fetch_or_recompute"] == pytest.approx((4 + 4 + 5) * per_chunk)
    assert slow["saved_fetch_or_recompute"] > slow["saved_always_fetch"]
    # 200 Gb/s: 2.7 ms a chunk, every run fetched, the decision is the same as always fetching.
    assert (fast["peer_runs_fetched"], fast["peer_runs_recomputed"]) == (2, 0)
    assert fast["prefill_seconds_fetch_or_recompute"] == pytest.approx(fast["prefill_seconds_always_fetch"])
    assert fast["saved_fetch_or_recompute"] > slow["saved_fetch_or_recompute"]


@pytest.mark.parametrize("changes, phrase", [
    ({"tokens_per_second": 0}, "--prefill-tokens-per-second"),
    ({"links": ()}, "--links"),
    ({"links": (1e9, -1.0)}, "--links"),
    ({"latency_seconds": -0.001}, "--link-latency-ms"),
])
def test_a_bad_model_names_the_flag(changes, phrase):
    with pytest.raises(ValueError, match=phrase):
        PrefillSettings(**changes)
