"""The chunk directory: owners by rendezvous hashing, holders publish, owners answer, shares move.

Location objects of several sidecars are wired by an in-memory network that
sends every message through its JSON form (as the control port does), so
what is tested is what travels.
"""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_offload_sidecar.peers.directory.holders import Directory
from kv_offload_sidecar.peers.directory.location import Location
from kv_offload_sidecar.peers.directory.location_wire import (
    MAX_PUBLISH_RECORDS,
    HolderClaim,
    LocateQuery,
    LocateReply,
    PublishBatch,
    key_digest,
    tail_of,
)
from kv_offload_sidecar.peers.directory.ownership import BUCKETS, OWNERS, OwnerTable
from kv_offload_sidecar.peers.directory.publisher import Publisher


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() + (0).to_bytes(4, "big") for i in range(n)]


class Net:
    """Locations by identity; messages go through json.dumps/json.loads and are counted."""

    def __init__(self, names: list[str]) -> None:
        self.nodes: dict[str, Location] = {}
        self.records = {n: 0 for n in names}  # publish records received per node
        self.messages = 0
        for n in names:
            self.nodes[n] = Location(n, interval_seconds=1.0, deadline_seconds=1.0, call=self._caller(n))
        for a in names:
            for b in names:
                if a != b:
                    self.nodes[a].member_joined(b)

    def _caller(self, sender: str):
        async def call(target: str, op: str, body: dict, timeout: float):
            self.messages += 1
            wire = json.loads(json.dumps(body))
            node = self.nodes[target]
            if op == "publish":
                self.records[target] += PublishBatch.from_dict(wire).records
                return json.loads(json.dumps(node.on_publish(sender, wire)))
            return json.loads(json.dumps(node.on_locate(sender, wire)))
        return call

    async def settle(self, rounds: int = 3) -> None:
        """Publish until nothing is left to send (each round: every node's interval)."""
        for _ in range(rounds):
            for node in self.nodes.values():
                node.publish_once()
            await asyncio.sleep(0)
            for node in self.nodes.values():
                for t in list(node._tasks):
                    await t

    def store(self, name: str, ks: list[bytes]) -> None:
        self.nodes[name].hint_chain(ks)
        for k in ks:
            self.nodes[name].record(k, True)


# ---- ownership -----------------------------------------------------------------------------

def test_every_member_computes_the_same_owners_whatever_the_join_order():
    names = [f"pod-{i}" for i in range(12)]
    tables = []
    for seed in range(3):
        order = names[:]
        random.Random(seed).shuffle(order)
        t = OwnerTable(order[0])
        for n in order[1:]:
            t.add(n)
        tables.append(t)
    for b in range(0, BUCKETS, 97):
        assert len({t.owner_of_bucket(b) for t in tables}) == 1


def test_a_join_takes_only_its_share_and_a_leave_moves_only_the_leavers_buckets():
    t = OwnerTable("pod-0")
    for i in range(1, 16):
        t.add(f"pod-{i}")
    before = [t.owners_of_bucket(b) for b in range(BUCKETS)]
    moved, ousted = t.join("pod-new")
    after = [t.owners_of_bucket(b) for b in range(BUCKETS)]
    changed = [b for b in range(BUCKETS) if before[b] != after[b]]
    assert sorted(changed) == sorted(moved.tolist())
    assert all("pod-new" in after[b] and len(after[b]) == 2 for b in changed)
    assert 0.5 * 2 * BUCKETS / 17 < len(changed) < 1.5 * 2 * BUCKETS / 17
    # the member pushed out of each changed bucket is told, and only there
    pushed = {b: name for name, bs in ousted for b in bs.tolist()}
    assert sorted(pushed) == sorted(changed)
    assert all(pushed[b] in before[b] and pushed[b] not in after[b] for b in changed)
    gone = t.remove("pod-3")
    final = [t.owners_of_bucket(b) for b in range(BUCKETS)]
    assert [b for b in range(BUCKETS) if final[b] != after[b]] == sorted(gone.tolist())
    assert not any("pod-3" in f for f in final)


def test_buckets_spread_evenly_over_a_large_pool():
    t = OwnerTable("pod-0")
    for i in range(1, 256):
        t.add(f"pod-{i}")
    counts = [t.buckets_of(f"pod-{i}").size for i in range(256)]
    mean = OWNERS * BUCKETS / 256
    assert sum(counts) == OWNERS * BUCKETS and max(counts) < 1.6 * mean and min(counts) > 0.5 * mean


# ---- wire --------------------------------------------------------------------------------

digests = st.integers(0, (1 << 64) - 1)


@given(st.lists(st.tuples(digests, st.integers(0, (1 << 32) - 1)), max_size=40),
       st.lists(digests, max_size=40), st.integers(1, 1 << 40), st.booleans(), st.booleans())
def test_publish_batches_round_trip_through_json(adds, removes, seq, reset, resync_me):
    batch = PublishBatch("0a1b", seq, reset, resync_me, tuple(adds), tuple(removes))
    assert PublishBatch.from_dict(json.loads(json.dumps(batch.to_dict()))) == batch


@given(st.lists(digests, min_size=1, max_size=256))
def test_locate_queries_round_trip_through_json(ds):
    q = LocateQuery(tuple(ds))
    assert LocateQuery.from_dict(json.loads(json.dumps(q.to_dict()))) == q


@pytest.mark.parametrize("reply", [{"holders": [["a", 0]]}, {"holders": [["", 1]]}, {"holders": "a"},
                                   {"holders": [["a", 1, 2]]}, {"holders": [["a", True]]}, [],
                                   {"holders": [["a", 1]] * 9}])
def test_malformed_locate_replies_are_refused(reply):
    with pytest.raises(ValueError):
        LocateReply.from_dict(reply)


def test_a_publish_larger_than_one_message_is_refused():
    batch = PublishBatch("ab", 1, False, False, tuple((i, 0) for i in range(MAX_PUBLISH_RECORDS)), (1,))
    with pytest.raises(ValueError, match="split it"):
        PublishBatch.from_dict(batch.to_dict())


# ---- directory -------------------------------------------------------------------------

def batch(seq: int, adds=(), removes=(), *, reset=False, epoch="aa") -> PublishBatch:
    return PublishBatch(epoch, seq, reset, False, tuple((d, tail_of(d)) for d in adds), tuple(removes))


def test_a_stream_must_start_with_a_reset_and_follow_its_seq():
    d = Directory()
    assert d.apply("h", batch(1, [5])) is True  # no state yet: resync
    assert d.apply("h", batch(1, [5], reset=True)) is False
    assert d.apply("h", batch(3, [6])) is True  # a gap
    assert d.apply("h", batch(2, [6], epoch="bb")) is True  # another epoch (a restart)
    assert d.apply("h", batch(2, [6], removes=[5])) is False
    assert d.holders_of(5) == [] and d.holders_of(6) == ["h"] and len(d) == 1
    assert d.apply("h", batch(1, [7], reset=True, epoch="bb")) is False  # the restart's reset
    assert d.holders_of(6) == [] and d.holders_of(7) == ["h"]


def test_every_holder_is_kept_the_most_recent_publisher_first():
    d = Directory()
    for i in range(40):
        d.apply(f"h{i}", batch(1, [9], reset=True))
    assert d.holders_of(9) == [f"h{i}" for i in reversed(range(40))] and len(d) == 40
    d.apply("h3", batch(2, removes=[9]))
    d.apply("h0", batch(2, [9]))  # h0 published it again: it is the most recent now
    assert d.holders_of(9)[:2] == ["h0", "h39"] and "h3" not in d.holders_of(9) and len(d) == 39
    assert d.entries_of("h0") == 1


def test_a_holder_keeps_its_last_few_chains_through_a_chunk():
    d = Directory(tails=2)
    chain = [key_digest(k) for k in keys("m", 8)]
    first = chain[0]
    d.apply("h", PublishBatch("aa", 1, True, False, ((first, tail_of(chain[5])),), ()))
    d.apply("h", PublishBatch("aa", 2, False, False, ((first, tail_of(chain[2])),), ()))  # another request
    assert d.locate(chain) == (HolderClaim("h", 6),)  # the deeper chain still counts
    d.apply("h", PublishBatch("aa", 3, False, False, ((first, 77),), ()))
    assert d.locate(chain) == (HolderClaim("h", 3),)  # only the last two are kept
    assert len(d) == 1


def test_locate_ranks_the_holder_whose_chain_goes_deepest_first():
    d = Directory()
    chain = [key_digest(k) for k in keys("c", 6)]
    d.apply("short", PublishBatch("aa", 1, True, False, ((chain[0], tail_of(chain[2])),), ()))
    d.apply("long", PublishBatch("aa", 1, True, False, ((chain[0], tail_of(chain[5])),), ()))
    d.apply("other", PublishBatch("aa", 1, True, False, ((chain[0], 12345),), ()))  # most recent
    got = d.locate(chain)
    assert got == (HolderClaim("long", 6), HolderClaim("short", 3), HolderClaim("other", 1))
    assert [h.identity for h in d.locate(chain, exclude="long")] == ["short", "other"]
    assert d.locate([key_digest(b"unknown")]) == ()


def test_purge_and_dropped_buckets_forget_entries_and_streams():
    d = Directory()
    d.apply("a", batch(1, [1, 2, 1 << 63], reset=True))
    d.apply("b", batch(1, [1], reset=True))
    assert d.purge("a") == 3 and d.holders_of(1) == ["b"] and not d.has_stream("a")
    assert d.apply("a", batch(2, [4])) is True  # it must reset again
    d.apply("b", batch(2, [1 << 63]))
    gone = np.zeros(BUCKETS, dtype=bool)
    gone[BUCKETS // 2:] = True
    assert d.drop_buckets(gone) == 1
    assert d.holders_of(1 << 63) == [] and len(d) == 1


def test_one_holder_cannot_fill_an_owner_past_its_cap():
    d = Directory(max_entries_per_holder=10)
    d.apply("liar", batch(1, range(100), reset=True))
    assert d.entries_of("liar") == 10 and len(d) == 10


# ---- publisher ---------------------------------------------------------------------------

def test_changes_between_publishes_net_out_and_go_to_each_digests_owner():
    table = OwnerTable("me")
    table.add("other")
    p = Publisher("me")
    p.owner_joined("me")
    p.owner_joined("other")
    assert [m.reset for _, msgs in p.take(table) for m in msgs] == [True, True]  # (empty) full shares
    ks = keys("n", 40)
    for k in ks:
        p.record(k, True)
    p.record(ks[0], False)
    p.record(b"flap", True)
    p.record(b"flap", False)
    out = dict(p.take(table))
    sent = {d for msgs in out.values() for m in msgs for d, _ in m.adds}
    assert sent == {key_digest(k) for k in ks[1:]}
    for owner, msgs in out.items():
        assert all(owner in table.owners_of(d) for m in msgs for d, _ in m.adds)
        assert [m.seq for m in msgs] == [2] and not msgs[0].reset and msgs[0].removes == ()
    assert p.take(table) == []


def test_a_reset_carries_the_full_share_split_into_bounded_messages():
    table = OwnerTable("me")
    p = Publisher("me")
    for i in range(MAX_PUBLISH_RECORDS + 5):
        p.record_digest(i << 20, True)
    (owner, msgs), = p.take(table)
    assert owner == "me" and [m.reset for m in msgs] == [True, False] and [m.seq for m in msgs] == [1, 2]
    assert sum(m.records for m in msgs) == MAX_PUBLISH_RECORDS + 5


def test_a_chunk_takes_the_tail_of_the_chain_it_was_stored_in():
    table = OwnerTable("me")
    p = Publisher("me")
    p.owner_joined("me")
    p.take(table)
    ks = keys("t", 5)
    p.hint_chain(ks)
    for k in ks:
        p.record(k, True)
    adds = {d: t for _, msgs in p.take(table) for m in msgs for d, t in m.adds}
    assert set(adds.values()) == {tail_of(key_digest(ks[-1]))}
    longer = ks + keys("u", 3)
    p.hint_chain(longer, held=True)  # a lookup through the held chain: its first key's tail moves on
    adds = {d: t for _, msgs in p.take(table) for m in msgs for d, t in m.adds}
    assert adds == {key_digest(ks[0]): tail_of(key_digest(longer[-1]))}


# ---- locations wired together ----------------------------------------------------------------

async def test_every_member_finds_every_chunk_after_one_publish_with_one_owner_message():
    net = Net([f"pod-{i}" for i in range(6)])
    await net.settle()
    stored = {f"pod-{i}": keys(f"s{i}", 30) for i in range(6)}
    for name, ks in stored.items():
        net.store(name, ks)
    await net.settle()
    for asker in net.nodes.values():
        for holder, ks in stored.items():
            if holder == asker.identity:
                continue
            before = net.messages
            owner, holders = await asker.locate(ks, 1.0)
            assert holders[0] == HolderClaim(holder, 30)  # the chain's tail: the whole run
            assert net.messages - before == (0 if owner == asker.identity else 1)
    total = sum(len(n.directory) for n in net.nodes.values())
    assert total == OWNERS * 180 and all(n.status()["pending"] == 0 for n in net.nodes.values())


async def test_a_joining_member_receives_only_its_share_and_a_leaving_ones_buckets_move_on():
    names = [f"pod-{i}" for i in range(8)]
    net = Net(names)
    for name in names:
        net.store(name, keys(name, 400))
    await net.settle()
    held = 8 * 400
    assert sum(len(n.directory) for n in net.nodes.values()) == OWNERS * held
    # a newcomer (an empty store) joins: it gets about 2/9 of the entries, and the owners it
    # pushes out hear removes of those (no more), nobody else hears anything
    net.records = dict.fromkeys(net.records, 0)
    new = Location("pod-new", interval_seconds=1.0, deadline_seconds=1.0, call=net._caller("pod-new"))
    net.nodes["pod-new"] = new
    net.records["pod-new"] = 0
    for name in names:
        new.member_joined(name)
        net.nodes[name].member_joined("pod-new")
    await net.settle()
    assert 0 < sum(net.records[n] for n in names) <= net.records["pod-new"]
    assert 0.5 * 2 * held / 9 < net.records["pod-new"] < 1.5 * 2 * held / 9
    assert net.records["pod-new"] == len(new.directory)
    assert sum(len(n.directory) for n in net.nodes.values()) == OWNERS * held  # the old owners dropped them
    # pod-3 leaves: its buckets go to their runners-up, its own chunks are forgotten
    net.records = dict.fromkeys(net.records, 0)
    gone = net.nodes.pop("pod-3")
    for node in net.nodes.values():
        node.member_left("pod-3")
    await net.settle()
    assert sum(net.records.values()) < 1.5 * 4 * held / 9  # (its 2/9 of the digests, to both owners)
    assert sum(len(n.directory) for n in net.nodes.values()) == OWNERS * (held - 400)
    some = keys("pod-5", 400)
    owner, holders = await net.nodes["pod-0"].locate(some[7:], 1.0)
    assert owner != "pod-3" and holders[0].identity == "pod-5"
    assert len(gone.directory) > 0  # what it owned left with it; the holders re-sent it elsewhere


async def test_a_restarted_member_replaces_what_owners_had_from_its_previous_life():
    names = ["a", "b", "c"]
    net = Net(names)
    net.store("a", keys("old", 50))
    await net.settle()
    assert sum(n.directory.entries_of("a") for n in net.nodes.values()) == OWNERS * 50
    for n in ("b", "c"):
        net.nodes[n].member_left("a")
    fresh = Location("a", interval_seconds=1.0, deadline_seconds=1.0, call=net._caller("a"))
    net.nodes["a"] = fresh
    for n in ("b", "c"):
        fresh.member_joined(n)
        net.nodes[n].member_joined("a")
    net.store("a", keys("new", 5))
    await net.settle()
    assert sum(n.directory.entries_of("a") for n in net.nodes.values()) == OWNERS * 5
    owner, holders = await net.nodes["b"].locate(keys("old", 50), 1.0)
    assert holders == ()


async def test_an_owner_that_lost_a_holder_asks_for_its_share_again():
    """Asymmetric failure: b purged a (its link to a dropped) while a's link to b stayed up."""
    net = Net(["a", "b"])
    ks = keys("mine", 40)
    net.store("a", ks)
    await net.settle()
    b = net.nodes["b"]
    mine_at_b = b.directory.entries_of("a")
    b.member_left("a")
    b.member_joined("a")  # b's link to a is back; a never noticed anything
    await net.settle()
    assert b.directory.entries_of("a") == mine_at_b > 0


async def test_a_publish_that_crosses_a_join_leaves_no_entry_at_the_owner_pushed_out():
    """The owners see the newcomer before the holder does: the holder's publishes still reach
    them for buckets they gave away, and its removes after the join fix that."""
    net = Net(["a", "b", "c"])
    new = Location("n", interval_seconds=1.0, deadline_seconds=1.0, call=net._caller("n"))
    net.nodes["n"], net.records["n"] = new, 0
    for name in ("b", "c"):
        net.nodes[name].member_joined("n")
        new.member_joined(name)
    net.store("a", keys("crossing", 300))
    await net.settle()  # a does not know n yet
    net.nodes["a"].member_joined("n")
    new.member_joined("a")
    await net.settle()
    assert sum(len(node.directory) for node in net.nodes.values()) == OWNERS * 300


async def test_a_member_that_cannot_reach_another_still_finds_what_a_third_one_holds():
    """Asymmetric partition: a dropped b from its view, b and the others keep a."""
    net = Net(["a", "b", "c", "d"])
    net.nodes["a"].member_left("b")
    held = keys("third", 200)
    net.store("c", held)
    await net.settle()
    for reader in ("a", "b", "d"):
        found = [(await net.nodes[reader].locate([k], 1.0))[1] for k in held]
        assert all(h and h[0].identity == "c" for h in found), reader


async def _c_holds(tag: str) -> tuple[Net, list[bytes]]:
    """Three nodes, settled after "c" stored 60 keys of ``tag``."""
    net = Net(["a", "b", "c"])
    held = keys(tag, 60)
    net.store("c", held)
    await net.settle()
    return net, held


async def test_a_locate_the_primary_owner_cannot_answer_goes_to_the_runner_up():
    net, held = await _c_holds("fallback")
    a = net.nodes["a"]
    reach = a._call

    async def b_unreachable(target: str, op: str, body: dict, timeout: float):
        if target == "b":
            raise ConnectionError("b is cut off")
        return await reach(target, op, body, timeout)

    a._call = b_unreachable
    failed: list[str] = []
    behind_b = [k for k in held if a.owner_of(k) == "b"]
    for k in behind_b:
        owner, holders = await a.locate([k], 1.0, lambda o, exc: failed.append(o))
        assert owner != "b" and holders[0].identity == "c"
    assert behind_b and failed == ["b"] * len(behind_b)


async def test_a_primary_owner_that_hangs_is_hedged_by_the_runner_up_before_the_deadline():
    net, held = await _c_holds("hedge")
    a = net.nodes["a"]
    reach, silence = a._call, asyncio.Event()

    async def b_silent(target: str, op: str, body: dict, timeout: float):
        if target == "b":
            await silence.wait()  # cut off without an answer
        return await reach(target, op, body, timeout)

    a._call = b_silent
    k = next(k for k in held if a.owner_of(k) == "b")
    owner, holders = await asyncio.wait_for(a.locate([k], 4.0), 3.0)  # the hedge: after 1 s
    assert owner != "b" and holders[0].identity == "c"
    silence.set()
