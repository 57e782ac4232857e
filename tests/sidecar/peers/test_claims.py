"""False claims: a peer that claims chunks it does not serve costs only misses, rate-limited."""

from __future__ import annotations

import functools

import kv_offload_sidecar.sidecar
from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.peers.claims import ClaimAudit
from kv_offload_sidecar.sidecar import Sidecar
from kv_offload_tools.chaos.chunks import chunk_keys
from sidecar_support import Clock, identified, settled

# Deadline of the victim's requests: an anti-hang bound (the liar answers at once, and an
# exchange it misses is a failure, not a false claim).
REQUEST_DEADLINE_SECONDS = 30.0


def test_an_honest_peer_with_a_few_stale_claims_stays_trusted():
    clock = Clock()
    audit = ClaimAudit(min_false=32, clock=clock)
    for _ in range(200):  # 200 requests of 8 chunks, one stale chunk in every 10th request
        audit.record("honest", 8, 8)
        clock.now += 0.01
    for _ in range(20):
        audit.record("honest", 8, 7)
    assert audit.distrusted() == set()


def test_a_peer_claiming_everything_is_left_alone_with_a_doubling_backoff():
    clock = Clock()
    false = []
    audit = ClaimAudit(min_false=32, backoff_seconds=5.0, max_backoff_seconds=12.0, clock=clock,
                       on_false_claims=false.append)
    for _ in range(8):
        audit.record("liar", 4, 0)
    assert audit.distrusted() == {"liar"} and sum(false) == 32
    clock.now += 5.1
    assert audit.distrusted() == set()
    for _ in range(8):
        audit.record("liar", 4, 0)
    assert audit.distrusted() == {"liar"}
    clock.now += 5.1
    assert audit.distrusted() == {"liar"}  # 10 s the second time
    clock.now += 5.0
    for _ in range(8):
        audit.record("liar", 4, 0)
    clock.now += 11.9
    assert audit.distrusted() == {"liar"}  # capped at 12 s
    clock.now += 0.2
    assert audit.distrusted() == set()


async def test_a_lying_member_costs_the_pool_only_misses_and_few_messages(make_settings, monkeypatch):
    """A compromised member (it holds the pool key) publishes every key the victim asks for."""
    # The audit's clock stands still: the whole test is one back-off period, however slowly
    # the machine runs it (the back-off itself is the unit tests' above).
    monkeypatch.setattr(kv_offload_sidecar.sidecar, "ClaimAudit", functools.partial(ClaimAudit, clock=Clock()))
    liar_settings = make_settings(identity="liar")
    victim_settings = make_settings(identity="victim", fetch_deadline_seconds=REQUEST_DEADLINE_SECONDS,
                                    static_peers=(f"127.0.0.1:{liar_settings.network.base_port}",))
    liar, victim = identified(Sidecar(liar_settings)), identified(Sidecar(victim_settings))
    async with running(liar), running(victim):
        keys = chunk_keys("claimed", 400)
        for k in keys:  # the lie: it tells the owners it holds all of them, its store holds none
            liar.location.record(k, True)
        await settled(liar, victim)
        assert len(liar.location.directory) + len(victim.location.directory) == 2 * len(keys)  # two owners
        answers = [await victim.lookup(keys[i:i + 4], REQUEST_DEADLINE_SECONDS) for i in range(0, 400, 4)]
        loads = [await victim.load(keys[i:i + 4], REQUEST_DEADLINE_SECONDS) for i in range(0, 40, 4)]
        assert all(a == (0, 0) for a in answers) and all(p == [] for p in loads)  # only misses
        messages = victim.metrics.lookup_messages._value.get()
        owner_queries = sum(victim.location.owner_of(keys[i]) == "liar" for i in range(0, 400, 4)) + \
            sum(victim.location.owner_of(keys[i]) == "liar" for i in range(0, 40, 4))
        # 32 false chunks, then the liar is not asked any more: what remains is at most the owner
        # query every lookup costs anyway (one message, whoever holds what)
        assert messages - owner_queries <= 33, (messages, owner_queries)
        assert victim.metrics.peer_false_claims._value.get() >= 32
        assert "liar" in victim.claims.distrusted()
        assert len(victim.store) == 0 and victim.metrics.integrity_failures._value.get() == 0
