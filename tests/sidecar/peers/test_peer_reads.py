"""The engine path's peer side, with sidecars in this process: locate, exchanges with one or more
holders, what the asker keeps of fetched chunks, and fetch-or-recompute."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.peers import fetched_copies, peer_reads
from kv_offload_sidecar.sidecar import UNLOADED_AFTER_DEADLINES, Sidecar
from kv_offload_tools.chaos.chunks import chunk_keys
from sidecar_support import Clock, identified, settled, store_zeros
from waiting import wait_for_async

# Fetch deadline of the tests that must not see a give-up: an anti-hang bound (a busy
# machine may take longer than a real deadline to answer, and the test would fail on time).
REQUEST_DEADLINE_SECONDS = 30.0


def _holder_and_asker(make_settings, **asker: object) -> tuple[Sidecar, Sidecar]:
    """Sidecar "holder" and sidecar "asker" (linked to it, with ``asker``'s settings)."""
    holder_settings = make_settings(identity="holder")
    peers = (f"127.0.0.1:{holder_settings.network.base_port}",)
    return identified(Sidecar(holder_settings)), identified(Sidecar(
        make_settings(identity="asker", static_peers=peers, **asker)))


async def _held(holder: Sidecar, asker: Sidecar, tag: str, n: int) -> list[bytes]:
    """``n`` chunk keys stored at ``holder``, once the directory says so to ``asker``."""
    keys = chunk_keys(tag, n)
    store_zeros(holder, keys)
    await settled(holder, asker)
    return keys


def _two_holders_and_an_asker(make_settings) -> tuple[Sidecar, Sidecar, Sidecar]:
    """Sidecars "a" and "b" (linked) and "asker" (linked to both)."""
    a_settings = make_settings(identity="a")
    b_settings = make_settings(identity="b", static_peers=(f"127.0.0.1:{a_settings.network.base_port}",))
    peers = (f"127.0.0.1:{a_settings.network.base_port}", f"127.0.0.1:{b_settings.network.base_port}")
    return identified(Sidecar(a_settings)), identified(Sidecar(b_settings)), identified(Sidecar(
        make_settings(identity="asker", static_peers=peers)))


async def test_a_lookup_fetches_its_hits_and_with_cold_copies_the_load_demotes_them(make_settings):
    holder, asker = _holder_and_asker(make_settings, peer_copies="cold")
    async with running(holder), running(asker):
        keys, mine = chunk_keys("chain", 6), chunk_keys("own", 4)
        store_zeros(holder, keys)
        store_zeros(asker, mine)
        await settled(holder, asker)
        # The admin lookup only counts: nothing moves.
        assert await asker.lookup(keys, 1.0, fetch=False) == (0, 6)
        assert len(asker.store) == 4
        before = asker.metrics.lookup_messages._value.get()
        assert await asker.lookup(keys, 1.0) == (0, 6)  # the engine's: the chunks start coming
        pins = await asker.load(keys, 1.0)
        assert [p.key for p in pins] == keys
        for p in pins:
            p.release()
        owner_remote = asker.location.owner_of(keys[0]) != "asker"
        assert asker.metrics.lookup_messages._value.get() - before == 1 + owner_remote
        # Loaded copies go to the cold end (the last one coldest), the asker's own chunks stay.
        order = list(asker.store._visible)
        assert order[:6] == list(reversed(keys)) and set(order[6:]) == set(mine)
        # A second lookup finds them here.
        assert await asker.lookup(keys, 1.0) == (6, 0)


async def test_a_lookups_fetch_is_timed_from_the_lookup_to_its_last_chunk_landed(make_settings):
    holder, asker = _holder_and_asker(make_settings)
    async with running(holder), running(asker):
        keys = await _held(holder, asker, "timed", 4)
        landed = asker.metrics.engine_transfer.labels(op="load", phase="lookup_to_landed")
        assert await asker.lookup(keys, 1.0, fetch=False) == (0, 4)  # counts only: not timed
        assert landed._sum.get() == 0
        assert await asker.lookup(keys, 1.0) == (0, 4)
        pins = await asker.load(keys, 1.0)
        for p in pins:
            p.release()
        # One observation, covering the lookup and the whole transfer.
        await wait_for_async("the fetch's span observed", lambda: landed._sum.get() > 0)
        assert {s.name: s.value for s in landed._samples()}["_count"] == 1


async def test_a_lookup_asks_the_holders_claimed_run_with_its_lookup_not_one_chunk_first(make_settings):
    holder, asker = _holder_and_asker(make_settings)
    async with running(holder), running(asker):
        keys = await _held(holder, asker, "claimed", 6)
        data = await asker.peers.data_links.open(asker.peers.connected("holder"), REQUEST_DEADLINE_SECONDS)
        fetch_counted, asked = data.fetch_counted, []

        async def recorded(*args, **kwargs):
            asked.append(kwargs["first"])
            return await fetch_counted(*args, **kwargs)

        data.fetch_counted = recorded
        assert await asker.lookup(keys, REQUEST_DEADLINE_SECONDS) == (0, 6)
        pins = await asker.load(keys, REQUEST_DEADLINE_SECONDS)
        assert [p.key for p in pins] == keys
        for p in pins:
            p.release()
        # The whole claimed run went out with the LOOKUP (the fetch's window bounds it).
        assert asked == [6]


async def test_a_holder_named_for_a_chunk_it_lost_is_one_false_claim_and_a_miss(make_settings):
    holder, asker = _holder_and_asker(make_settings)
    async with running(holder), running(asker):
        keys = chunk_keys("stale", 3)
        for k in keys:  # published as held, never stored: what an owner names before an eviction is heard
            holder.location.record(k, True)
        await settled(holder, asker)  # the asker's link up: else it would not even ask the holder
        assert await asker.lookup(keys, REQUEST_DEADLINE_SECONDS) == (0, 0)
        assert await asker.load(keys, REQUEST_DEADLINE_SECONDS) == []
        assert asker.metrics.peer_false_claims._value.get() >= 1
        assert len(asker.store) == 0


async def test_a_load_that_has_every_chunk_before_its_exchange_ends_still_drops_the_copies(make_settings):
    # The load takes the last chunk as it lands and cancels the exchange, which has not
    # counted it yet: the chunks that landed are still copies, dropped once released.
    holder, asker = _holder_and_asker(make_settings)
    async with running(holder), running(asker):
        keys = await _held(holder, asker, "lingering", 4)
        data = await asker.peers.data_links.open(asker.peers.connected("holder"), REQUEST_DEADLINE_SECONDS)
        fetch = data.fetch

        async def fetch_then_linger(*args, **kwargs):
            got = await fetch(*args, **kwargs)
            await asyncio.Event().wait()  # still finishing when the load holds every chunk
            return got

        data.fetch = fetch_then_linger
        pins = await asker.load(keys, REQUEST_DEADLINE_SECONDS)
        assert [p.key for p in pins] == keys
        for p in pins:
            p.release()
        assert len(asker.store) == 0 and len(holder.store) == 4


async def test_by_default_the_asker_keeps_no_copy_once_loaded_and_the_holder_keeps_them_hot(make_settings):
    holder, asker = _holder_and_asker(make_settings)
    async with running(holder), running(asker):
        keys, older = chunk_keys("chain", 6), chunk_keys("older", 3)
        store_zeros(holder, keys)
        store_zeros(holder, older)  # stored after keys: keys are colder at the holder
        await settled(holder, asker)
        assert await asker.lookup(keys, 1.0) == (0, 6)
        pins = await asker.load(keys, 1.0)
        assert [bytes(p.view[:1]) for p in pins] == [b"\0"] * 6 and len(asker.store) == 6
        for p in pins:
            p.release()
        # Released: the asker's store is empty again, the holder's copies were touched by the read.
        assert len(asker.store) == 0 and asker.store.stats()["free_slots"] == asker.store.num_slots
        # (every one of them hotter than the older chunks; lanes may serve them in any order)
        assert set(list(holder.store._visible)[-6:]) == set(keys)
        await settled(holder, asker)
        assert await asker.lookup(keys, 1.0) == (0, 6)  # still in the pool, at the holder
        for p in await asker.load(keys, 1.0):
            p.release()


async def test_a_prefix_split_over_two_holders_is_fetched_from_both(make_settings):
    a, b, asker = _two_holders_and_an_asker(make_settings)
    async with running(a), running(b), running(asker):
        keys = chunk_keys("conversation", 7)
        store_zeros(a, keys[:3])  # turn 1 ran on a
        store_zeros(b, keys[3:5])  # turn 2 on b, which dropped the copies of turn 1 it had loaded
        store_zeros(asker, keys[5:6])  # and one chunk the asker computed itself
        await settled(a, b, asker)
        before = asker.metrics.lookup_messages._value.get()
        assert await asker.lookup(keys, 1.0) == (0, 6)
        pins = await asker.load(keys, 1.0)
        assert [p.key for p in pins] == keys[:6]
        for p in pins:
            p.release()
        # Two holders: an owner question (unless the asker owns the key) and an exchange each,
        # and one owner question for the key after the asker's own chunk (nobody holds it).
        assert 2 <= asker.metrics.lookup_messages._value.get() - before <= 5
        assert [k for k in keys if k in asker.store] == keys[5:6]


async def test_a_run_slower_to_fetch_than_to_recompute_is_a_miss(make_settings):
    # 16 tokens per chunk at 10^12 tokens/s: recomputing 4 chunks takes 64 ps, never slower than a fetch.
    holder, asker = _holder_and_asker(make_settings, prefill_tokens_per_second=1e12)
    async with running(holder), running(asker):
        first, second = chunk_keys("first", 4), chunk_keys("second", 4)
        store_zeros(holder, first + second)
        await settled(holder, asker)
        decisions = asker.metrics.fetch_decisions
        # The holder is not measured yet: its run is fetched, and measures it.
        assert await asker.lookup(first, 1.0) == (0, 4)
        for p in await asker.load(first, 1.0):
            p.release()
        assert decisions.labels(decision="fetch")._value.get() == 1
        speeds = asker.reads.cost.speeds.view()["holder"]
        assert speeds["latency_seconds"] > 0 and speeds["bytes_per_second"] > 0
        # Now it is known to be slower than recomputing: a miss, nothing moves.
        received = asker.metrics.peer_bytes.labels(direction="received")._value.get()
        assert await asker.lookup(second, 1.0) == (0, 0)
        assert await asker.load(second, 1.0) == []
        assert decisions.labels(decision="recompute")._value.get() >= 1
        assert asker.metrics.peer_bytes.labels(direction="received")._value.get() == received


async def test_a_route_hint_ranks_the_pods_by_the_prefix_each_holds_and_moves_nothing(make_settings):
    a, b, asker = _two_holders_and_an_asker(make_settings)
    async with running(a), running(b), running(asker):
        keys = chunk_keys("session", 6)
        store_zeros(a, keys[:5])
        store_zeros(b, keys[:2])
        store_zeros(asker, keys[:1])
        await settled(a, b, asker)
        order = list(a.store._visible)
        hint = await asker.route_hint(keys, 1.0)
        assert [(h["pod"], h["chunks"]) for h in hint] == [("a", 5), ("b", 2), ("asker", 1)]
        assert hint[0]["address"] == a.control_address and hint[2]["address"] == asker.control_address
        assert list(a.store._visible) == order and len(asker.store) == 1  # no LRU touched, nothing moved


async def test_chunks_a_lookup_fetched_and_no_load_took_are_let_go_after_four_deadlines(make_settings,
                                                                                         monkeypatch):
    # The age of a fetched chunk is read on a clock the test moves (the fetch itself runs on
    # the event loop's own time, with a deadline that only bounds a hang).
    clock = Clock()
    monkeypatch.setattr(fetched_copies, "time", SimpleNamespace(monotonic=clock))
    holder, asker = _holder_and_asker(make_settings, fetch_deadline_seconds=REQUEST_DEADLINE_SECONDS)
    let_go_after = UNLOADED_AFTER_DEADLINES * REQUEST_DEADLINE_SECONDS
    async with running(holder), running(asker):
        keys, other = chunk_keys("aborted", 3), chunk_keys("other", 1)
        store_zeros(holder, keys)
        await settled(holder, asker)
        assert await asker.lookup(keys, REQUEST_DEADLINE_SECONDS) == (0, 3)  # the engine never loads it
        await wait_for_async("the fetched chunks in the asker's store", lambda: len(asker.store) == 3)
        clock.now += let_go_after - 0.01
        await asker.lookup(other, REQUEST_DEADLINE_SECONDS)
        assert len(asker.store) == 3  # not yet: a load may still come
        clock.now += 0.02
        await asker.lookup(other, REQUEST_DEADLINE_SECONDS)
        assert len(asker.store) == 0

def test_a_peers_failures_count_on_across_its_reconnects_so_its_back_off_grows():
    # The link's own count restarts at each reconnect; the engine path's blame resumes it, so
    # the back-off (links._back_off adds one to what report_failure saw) grows 1, 2, 3, ...
    seen: list[int] = []
    peers = SimpleNamespace(report_failure=lambda link, error, peer_at_fault: seen.append(link.failures))
    reads = peer_reads.PeerReads(location=None, peers=peers, claims=None, metrics=None, store=lambda: None,
                                 deadline_seconds=1.0, cost=None, stalls=SimpleNamespace(excuse=lambda t: False))
    link = SimpleNamespace(identity="slow", failures=0)
    for _ in range(3):
        link.failures = 0  # reconnected
        reads._blame(link, "fetch: missed its deadline", 0.0)
        link.failures += 1  # what the link's back-off counts
    assert seen == [0, 1, 2]
    # A failure this sidecar's own stall excuses counts nothing.
    reads._stalls = SimpleNamespace(excuse=lambda t: True)
    link.failures = 0
    reads._blame(link, "fetch: missed its deadline", 0.0)
    assert seen[-1] == 0


def test_a_holder_that_left_the_requests_owner_question_unanswered_is_judged_from_that_question():
    # One answer silence per peer a request: a holder that is also the chunks' primary owner,
    # for which the runner-up answered, has been silent since the owner question.
    reads = peer_reads.PeerReads(location=SimpleNamespace(owner_of=lambda key: "x"), peers=None, claims=None,
                                 metrics=None, store=lambda: None, deadline_seconds=1.0, cost=None, stalls=None)
    keys = chunk_keys("owned-by-x", 2)

    def since(holder: str, answered_by: str) -> float | None:
        return reads._silent_since(keys, (None, SimpleNamespace(identity=holder), answered_by), asked=12.5)

    assert since("x", answered_by="y") == 12.5  # x was asked first and did not answer
    assert since("x", answered_by="x") is None  # x answered as owner: a fresh question
    assert since("z", answered_by="y") is None  # another holder: never asked before
