"""Links per sidecar in bench scale: distinct peers per window, and a bounded pool's opens."""

from __future__ import annotations

from kv_offload_tools.bench.scale.links import connection_opens, peers_in_window


def test_peers_count_both_ends_within_the_sliding_window_only():
    contacts = [(0.0, "a", "b"), (1.0, "c", "a"), (5.0, "a", "d"), (20.0, "a", "e")]
    got = peers_in_window(contacts, window=10.0)
    # a saw b, c and d within 10 s; by 20 s only e is recent.
    assert got["max"] == 3 and got["members"] == 5
    assert peers_in_window(contacts, window=10.0, only=["b"])["max"] == 1
    # Counted where the contact was made only: a dialled b and d within 10 s (c dialled a).
    assert peers_in_window(contacts, window=10.0, only=["a"], ends="from")["max"] == 2
    assert peers_in_window(contacts, window=10.0, only=["a"], ends="to")["max"] == 1


def test_a_bounded_pool_opens_again_for_peers_it_had_to_close_and_after_the_keepalive():
    sends = [(0.0, "a"), (0.1, "b"), (0.2, "a"), (0.3, "c"), (0.4, "b"), (10.0, "b")]
    assert connection_opens(sends, bound=3, keepalive=5.0) == 4  # a, b, c; b again after idle
    assert connection_opens(sends, bound=2, keepalive=5.0) == 5  # c closes b (least recently used): b again
    assert connection_opens(sends, bound=3, keepalive=5.0, warm_until=1.0) == 1
