"""Liveness across a silent partition (``peers.liveness``), with real sidecars in pod namespaces:
an idle pod cut off is dropped with no request, within the heartbeat's stated time by a pod
whose data link to it is open and within the probe's by one that holds none, a request
that touches a cut pod waits only about the answer floor (a few of them when it must open a
data link to it; once, when the pod is both the chunks' owner and their holder), an owner whose
control port drops the question but whose data link answers keeps its hits, a heal is seen
within 5 s, and no half-open connection is left on either side."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.engine.pending_lookup import LookupReply
from kv_offload_sidecar.metrics import ANSWER_GIVE_UP_REASONS
from kv_offload_sidecar.peers.liveness import (
    HEARTBEAT_SECONDS,
    LOST_AFTER_SECONDS,
    MEMBER_PROBE_SECONDS,
    PROBE_TIMEOUT_SECONDS,
)
from kv_offload_testing import scrape
from kv_offload_tools.chaos.chunks import chunk_keys, store_chunks
from kv_offload_tools.netns.pool import NetnsPool
from kv_offload_tools.netns.probes import half_open
from waiting import wait_for

# Stated detection time of a silent peer, and what polling two sidecars on shared cores adds.
DETECTION_SECONDS = HEARTBEAT_SECONDS + LOST_AFTER_SECONDS
POLL_SLACK_SECONDS = 0.5
# A heal is seen within this (issue 48 item 2).
HEAL_SECONDS = 5.0


def _connected(pool: NetnsPool, viewer: int, other: int) -> bool:
    identity = pool[other].identity
    return any(p["identity"] == identity and p["state"] == "connected" for p in pool[viewer].peers())


def _data_open(pool: NetnsPool, viewer: int, other: int) -> bool:
    identity = pool[other].identity
    return any(p["identity"] == identity and p["data_open"] for p in pool[viewer].peers())


def _cut(pool: NetnsPool, pod: int) -> None:
    for other in range(pool.n):
        if other != pod:
            pool.net.partition(pod, other, one_way=False)


def _peer_view(pool: NetnsPool, viewer: int, other: int) -> dict:
    identity = pool[other].identity
    return next(p for p in pool[viewer].peers() if p["identity"] == identity)


def _lookup_with_pod_2_cut(pool: NetnsPool, reader: EngineClient, viewer: int, keys: list[bytes],
                           timeout: float) -> tuple[LookupReply, float, bool]:
    """``reader``'s (pod ``viewer``'s) lookup of ``keys`` just after pod-2 was cut off, the
    seconds it took, and whether the viewer still counted pod-2 connected after it; healed after."""
    try:
        _cut(pool, 2)
        started = time.monotonic()
        hits = reader.lookup(keys, timeout=timeout)
        took = time.monotonic() - started
        return hits, took, _connected(pool, viewer, 2)
    finally:
        pool.net.heal()


def _given_up(pool: NetnsPool, viewer: int) -> dict[str, int]:
    """The viewer's lookups that stopped waiting for a peer's answer, by reason."""
    samples = scrape.parse_metrics(pool[viewer].metrics_text())
    return {reason: int(scrape.value(samples, "kv_offload_peer_answers_given_up_total", reason=reason))
            for reason in ANSWER_GIVE_UP_REASONS}


def _tag_owned(pool: NetnsPool, owned: Callable[[list[str]], bool]) -> str:
    """A chunk_keys tag whose first key's owners (whom a lookup of them asks) satisfy ``owned``."""
    return next(tag for tag in (f"owned-{n}" for n in range(10_000))
                if owned(pool.owners_of(chunk_keys(tag, 1)[0])))


def _stored_on_pod_2_and_connected(pool: NetnsPool, tag: str, count: int) -> list[bytes]:
    """``count`` chunks stored on pod-2, the directory current and pods 0 and 1 connected to it."""
    keys = chunk_keys(tag, count)
    with pool.client(2) as writer:
        assert store_chunks(writer, keys, pool.chunk_bytes) == len(keys)
    pool.wait_directory_current()
    for viewer in (0, 1):
        assert wait_for("everyone connected to pod-2", lambda v=viewer: _connected(pool, v, 2))
    return keys


def test_an_idle_pod_cut_off_silently_is_dropped_by_heartbeat_or_probe_and_back_within_five_after_the_heal(
        fresh_netns_pool: NetnsPool):
    # pod-0 read from pod-2 (its data link is open and heartbeaten); pod-1 never did (pod-2 is a
    # member it holds no data connection to: only its probe watches it).
    pool = fresh_netns_pool
    keys = _stored_on_pod_2_and_connected(pool, "idle-cut", 2)
    with pool.client(0) as reader:
        assert reader.lookup(keys, timeout=1.0).peer == len(keys)
    assert _data_open(pool, 0, 2) and not _data_open(pool, 1, 2)
    limits = {0: DETECTION_SECONDS + POLL_SLACK_SECONDS,
              1: MEMBER_PROBE_SECONDS + PROBE_TIMEOUT_SECONDS + POLL_SLACK_SECONDS}
    try:
        _cut(pool, 2)
        cut_at = time.monotonic()
        lost = {}
        while len(lost) < 2 and time.monotonic() - cut_at < limits[1] + 1.0:
            for viewer in (0, 1):
                if viewer not in lost and not _connected(pool, viewer, 2):
                    lost[viewer] = time.monotonic() - cut_at
        assert len(lost) == 2 and all(lost[v] <= limits[v] for v in lost), lost
    finally:
        pool.net.heal()
    healed_at = time.monotonic()
    for viewer, other in ((0, 2), (1, 2), (2, 0), (2, 1)):
        wait_for(f"pod-{viewer} connected to pod-{other} again",
                 lambda v=viewer, o=other: _connected(pool, v, o), timeout=HEAL_SECONDS + 1.0)
    assert time.monotonic() - healed_at <= HEAL_SECONDS
    # Ends the cut left (closed on one side, still held on the other) are gone on both sides.
    wait_for("no half-open connection between the pods", lambda: not half_open(pool.net), timeout=10.0)


def test_a_lookup_that_touches_a_pod_just_cut_off_misses_after_the_answer_floor_not_the_deadline(
        fresh_netns_pool: NetnsPool):
    # pod-2 holds the chunks and is their primary owner: the lookup's owner question goes
    # unanswered, the runner-up names pod-2, and pod-2 is judged from that first question.
    pool = fresh_netns_pool
    keys = _stored_on_pod_2_and_connected(pool, "cut-holder", 4)
    with pool.client(0) as reader:
        assert reader.lookup(keys, timeout=1.0).peer == len(keys)  # held by pod-2, seen from pod-0
        more = chunk_keys(_tag_owned(pool, lambda owners: owners[0] == pool[2].identity), 4)
        with pool.client(2) as writer:
            assert store_chunks(writer, more, pool.chunk_bytes) == len(more)
        pool.wait_directory_current()
        hits, took, before_the_heartbeat = _lookup_with_pod_2_cut(pool, reader, 0, more, 1.0)
    assert hits.hits == 0
    assert _given_up(pool, 0) == {"silence": 1, "deadline": 0}
    # The fetch deadline is 1.0 s here; the answer wait follows pod-2's round trips (a 50 ms floor).
    assert took < 0.3, f"the lookup waited {took * 1e3:.0f} ms"
    assert before_the_heartbeat, "the heartbeat noticed first: this run proves nothing"
    for viewer in (0, 1):
        wait_for("pod-2 back", lambda v=viewer: _connected(pool, v, 2), timeout=HEAL_SECONDS + 1.0)


def test_a_lookup_that_must_open_a_data_link_to_a_pod_just_cut_off_misses_after_the_open_floor_not_the_deadline(
        fresh_netns_pool_each_plane: NetnsPool):
    # pod-1 never exchanged data with pod-2, so the lookup opens that data link, and the cut
    # drops its TCP connection attempt (tcp: the data connection; ucx: the one to pod-2's
    # control port dialled beside the endpoint): the open never reaches pod-2's host, and the
    # request waits only a few answer silences (pod-2's round trips, sampled from location
    # calls) instead of its deadline or the open's 5 s handshake bound.
    pool = fresh_netns_pool_each_plane
    pod_2 = pool[2].identity
    held = chunk_keys(_tag_owned(pool, lambda owners: pod_2 not in owners), 4)
    with pool.client(2) as writer:
        assert store_chunks(writer, held, pool.chunk_bytes) == len(held)
    pool.wait_directory_current()
    asked_of_pod_2 = _tag_owned(pool, lambda owners: owners[0] == pod_2)
    with pool.client(1) as reader:
        for _ in range(5):  # nobody holds it: each lookup is one location call to pod-2
            assert reader.lookup(chunk_keys(asked_of_pod_2, 1), timeout=3.0).hits == 0
        assert wait_for("pod-1 measured pod-2's round trip",
                        lambda: _peer_view(pool, 1, 2)["rtt_ms"] is not None)
        assert not _data_open(pool, 1, 2)
        hits, took, before_the_probe = _lookup_with_pod_2_cut(pool, reader, 1, held, 3.0)
    assert hits.hits == 0
    # Given up on pod-2's silence, not at the fetch deadline (1.0 s here) as when the whole
    # open counted as hearing from it.
    assert _given_up(pool, 1) == {"silence": 1, "deadline": 0}
    assert took < 0.8, f"the lookup waited {took * 1e3:.0f} ms"
    assert before_the_probe, "the probe noticed first: this run proves nothing"



def test_an_owner_whose_control_port_drops_the_question_but_whose_data_link_answers_keeps_its_hits(
        fresh_netns_pool: NetnsPool):
    # pod-2 holds the chunks and is their primary owner; pod-0's packets to pod-2's control port
    # are dropped, so each owner question goes unanswered, while their data link works. The ping
    # beside the question shows pod-2 alive: the runner-up names it and the lookup hits, where a
    # holder judged from the unanswered question alone would be given up at once.
    pool = fresh_netns_pool
    pod_2 = pool[2].identity
    tags = (f"asked-of-pod-2-{n}" for n in range(10_000))
    sets = [chunk_keys(t, 2) for t in itertools.islice(
        (t for t in tags if pool.owners_of(chunk_keys(t, 1)[0])[0] == pod_2), 3)]
    keys = _stored_on_pod_2_and_connected(pool, "data-link-opener", 2)
    with pool.client(2) as writer:
        for held in sets:
            assert store_chunks(writer, held, pool.chunk_bytes) == len(held)
    pool.wait_directory_current()
    with pool.client(0) as reader:
        assert reader.lookup(keys, timeout=1.0).peer == len(keys)
        assert _data_open(pool, 0, 2)
        try:
            pool.net.partition(0, 2, port=pool.base_port)
            peer_hits = [reader.lookup(held, timeout=3.0).peer for held in sets]
        finally:
            pool.net.heal()
    assert peer_hits == [2, 2, 2], (peer_hits, _given_up(pool, 0), _peer_view(pool, 0, 2))
    assert _given_up(pool, 0) == {"silence": 0, "deadline": 0}
