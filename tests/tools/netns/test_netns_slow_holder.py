"""A holder behind a slow link (``bench.netns_faults.capped_holder``), with real sidecars in pod
namespaces: its first fetch runs out of the deadline, that fetch prices it out
(``peers.fetch_cost``), and the requests after it no longer wait for the deadline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_tools.bench.netns_faults import capped_holder
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
    first, second = figures["first_half"], figures["second_half"]
    # The cap bites: a fetch ran out of the deadline (else this proves nothing) ...
    assert first["stalled"] >= 1, figures
    # ... and taught the pricing: later requests are recomputed at once, not waited out.
    assert figures["decisions"]["recompute"] >= 1, figures
    assert second["requests"] >= 10 and second["stalled"] <= 1, figures
    assert second["p99_ms"] < 500 * DEADLINE_SECONDS, figures
