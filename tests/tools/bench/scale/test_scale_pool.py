"""`bench scale`'s read: the sidecar's own PeerReads over a prefix on k holders, and over a replay."""

from __future__ import annotations

import hashlib

import pytest
from kv_offload_tools.bench.replay.cli import request_keys
from kv_offload_tools.bench.scale.lookups import replay_lookups
from kv_offload_tools.bench.scale.pool import DirectoryPool
from kv_offload_tools.workloads import ConversationSpec, conversation

# Keys of each holder's run of the prefix (a turn computed on that holder).
RUN = 3
# Keys after the runs that nobody holds (what the asker's engine computes).
UNHELD = 2


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest()[:16] + bytes(4) for i in range(n)]


async def _prefix_on(holders: int) -> tuple[DirectoryPool, list[bytes]]:
    """A pool of holders + 1 members; member j stored run j of one prefix (as the tier stores:
    its chain hinted, then written), and the owners heard of it."""
    pool = DirectoryPool(holders + 1, capacity=64, clock=lambda: 0.0)
    keys = _keys(f"prefix-{holders}", holders * RUN + UNHELD)
    for j in range(holders):
        run = keys[j * RUN:(j + 1) * RUN]
        pool.members[j].location.hint_chain(run)
        pool.members[j].store.put(run)
    await pool.publish()
    return pool, keys


@pytest.mark.parametrize("holders", [1, 2, 3, 4])
async def test_a_prefix_over_k_holders_costs_a_question_and_an_exchange_per_holder_and_a_question_for_the_end(
        holders):
    pool, keys = await _prefix_on(holders)
    asker = pool.members[holders]
    # Owner questions go to the owners of each run's first key and of the first key nobody
    # holds, except those the asker owns itself (no message).
    asked = [keys[j * RUN] for j in range(holders)] + [keys[holders * RUN]]
    remote = sum(asker.location.owner_of(k) != asker.name for k in asked)
    counter = asker.messages()
    served = await pool.serve(holders, keys)
    assert (served.local, served.peer, served.holders) == (0, holders * RUN, holders)
    assert served.holder_exchanges == holders and served.false_exchanges == 0
    assert served.owner_questions == remote
    # The member's own kv_offload_lookup_messages_total counted exactly what crossed the wire.
    assert asker.messages() - counter == served.messages == remote + holders
    assert remote + holders <= 2 * holders + 1


async def test_the_asker_keeps_no_fetched_copy_and_stores_what_its_engine_computed():
    pool, keys = await _prefix_on(3)
    await pool.serve(3, keys)
    assert list(pool.members[3].store.keys) == keys[3 * RUN:]
    for j in range(3):  # the holders keep their runs
        assert all(pool.members[j].store.contains(k) for k in keys[j * RUN:(j + 1) * RUN])


async def test_a_holder_named_for_a_run_it_evicted_is_one_false_exchange_and_the_rest_a_miss():
    pool, keys = await _prefix_on(2)
    pool.members[1].store.drop(keys[RUN:2 * RUN])  # evicted after the owner last heard
    served = await pool.serve(2, keys)
    assert (served.peer, served.holders, served.false_exchanges) == (RUN, 1, 1)
    assert served.holder_exchanges == 2 and served.messages == served.owner_questions + 2


def test_round_robin_conversations_spread_prefixes_over_holders_and_k_holders_cost_at_most_2k_plus_1():
    reqs = conversation(ConversationSpec(sessions=40, turns=5, think_seconds=30.0))
    stream = [(r.timestamp_ms / 1000.0, k) for r, k in zip(reqs, request_keys([r.hash_ids for r in reqs]))]
    f = replay_lookups("directory", 6, stream, capacity=400, interval=1.0, routing="round-robin")
    assert f.requests == len(reqs) and f.peer_hit_requests > 0
    assert f.messages == f.locate_messages + f.holder_exchanges  # counters and wire agree
    by = f.holders_view()
    assert sum(v["requests"] for v in by.values()) == f.peer_hit_requests
    assert max(int(k) for k in by) >= 3  # turns on different pods: prefixes span several holders
    for k, v in by.items():
        assert int(k) < v["messages_per_request"] <= 2 * int(k) + 1 + v["false_exchanges_per_request"], (k, v)
    # More holders, more messages.
    costs = [v["messages_per_request"] for _, v in sorted(by.items(), key=lambda kv: int(kv[0]))]
    assert costs == sorted(costs)
    exact = replay_lookups("exact", 6, stream, capacity=400, interval=1.0, routing="round-robin")
    assert abs(exact.hit_ratio - f.hit_ratio) < 0.05
