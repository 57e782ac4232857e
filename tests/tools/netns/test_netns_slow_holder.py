"""A holder behind a slow link (``bench.netns_faults.capped_holder``), with real sidecars in pod
namespaces: its first fetches run out (of the deadline, or of the answer silence once its chunks
stop coming), which prices it out (``peers.fetch_cost``) so the requests after them no longer wait;
without a prefill rate its back-off grows from one failure to the next."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_tools.bench.netns.faults import capped_holder
from kv_offload_tools.netns.pool import NetnsPool

# 64 tokens a chunk, 4 a batch: recomputing a batch takes 0.5 s, fetching it over the veth ms.
PREFILL_TOKENS_PER_SECOND = 512
# 32 kB/s: a batch of four 16 KiB chunks needs 2 s, twice the fetch deadline.
CAP_BITS = 256_000
DEADLINE_SECONDS = 1.0


@pytest.fixture
def priced_pool(netns_permitted: None) -> Iterator[NetnsPool]:
    pool = NetnsPool(3, fetch_deadline_seconds=DEADLINE_SECONDS,
                     extra_args=("--prefill-tokens-per-second", str(PREFILL_TOKENS_PER_SECOND))).start()
    try:
        yield pool
    finally:
        pool.stop()


def test_a_holder_behind_a_slow_link_is_priced_out_after_its_first_deadline(priced_pool: NetnsPool):
    figures = capped_holder(priced_pool, 2, CAP_BITS, seconds=8.0, lag_seconds=0.5)
    assert not figures["errors"], figures
    second = figures["second_half"]
    # The first fetches ran out (of the deadline, or of the answer silence once the chunks
    # stopped coming) and taught the pricing: a holder measured on a healthy link costs ms,
    # far below the 0.5 s a batch takes to recompute; this one is recomputed instead.
    assert figures["decisions"]["fetch"] >= 1 and figures["decisions"]["recompute"] >= 1, figures
    assert second["requests"] >= 10 and second["stalled"] <= 1, figures
    assert second["p99_ms"] < 500 * DEADLINE_SECONDS, figures


def test_without_a_prefill_rate_a_slow_holder_is_backed_off_longer_after_each_deadline(netns_permitted: None):
    # No pricing: every deadline the holder runs out ends its link; the failures count on across
    # the reconnects (the link's own count restarts at each), so the back-off grows.
    with NetnsPool(3, fetch_deadline_seconds=DEADLINE_SECONDS) as pool:
        figures = capped_holder(pool, 2, CAP_BITS, seconds=8.0, lag_seconds=0.5)
    assert not figures["errors"], figures
    assert figures["first_half"]["stalled"] + figures["second_half"]["stalled"] >= 3, figures
    assert figures["max_link_failures"] >= 3, figures
