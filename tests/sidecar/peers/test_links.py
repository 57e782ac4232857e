"""A failing peer's link backs off exponentially with full jitter, so the pods of a pool do not
all re-handshake a restarted peer at the same instants."""

from __future__ import annotations

import random

from kv_offload_sidecar.peers.links import backoff_delay


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
