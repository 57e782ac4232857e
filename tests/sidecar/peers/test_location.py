"""Key-summary deltas: pulls converge, logs bound memory, lookups pick one holder."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_offload_sidecar.peers.location import (
    DIGEST_BYTES,
    PeerSummaries,
    SummaryDelta,
    SummaryLog,
    key_digest,
    pack_digests,
    unpack_digests,
)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() + (0).to_bytes(4, "big") for i in range(n)]


def pull(log: SummaryLog, view: PeerSummaries, peer: str) -> SummaryDelta:
    epoch, seq = view.cursor(peer)
    # Round trip through the wire form, as the control plane does.
    delta = SummaryDelta.from_dict(log.delta_since(seq, epoch).to_dict())
    view.apply(peer, delta)
    return delta


def test_digest_is_eight_bytes_and_stable():
    assert len(key_digest(b"k")) == DIGEST_BYTES
    assert key_digest(b"k") == key_digest(b"k") != key_digest(b"j")


def test_first_pull_is_a_snapshot_then_deltas_carry_only_changes():
    log, view = SummaryLog(), PeerSummaries()
    ks = keys("a", 10)
    for k in ks:
        log.record(k, True)
    first = pull(log, view, "A")
    assert first.reset and len(first.added) == 10
    log.record(ks[0], False)
    log.record(b"new", True)
    second = pull(log, view, "A")
    assert not second.reset
    assert set(second.added) == {key_digest(b"new")} and set(second.removed) == {key_digest(ks[0])}
    assert not view.holds("A", ks[0]) and view.holds("A", b"new") and view.holds("A", ks[1])
    assert pull(log, view, "A").added == ()


def test_add_then_remove_between_pulls_nets_out():
    log, view = SummaryLog(), PeerSummaries()
    pull(log, view, "A")
    log.record(b"x", True)
    log.record(b"x", False)
    delta = pull(log, view, "A")
    assert not view.holds("A", b"x")
    assert key_digest(b"x") not in delta.added


def test_puller_behind_the_bounded_log_gets_a_full_snapshot():
    log, view = SummaryLog(log_limit=4), PeerSummaries()
    pull(log, view, "A")
    ks = keys("b", 20)
    for k in ks:
        log.record(k, True)
    delta = pull(log, view, "A")
    assert delta.reset
    assert all(view.holds("A", k) for k in ks)


def test_restarted_peer_new_epoch_resets_view():
    old, view = SummaryLog(), PeerSummaries()
    old.record(b"gone", True)
    pull(old, view, "A")
    restarted = SummaryLog()
    restarted.record(b"fresh", True)
    delta = pull(restarted, view, "A")
    assert delta.reset
    assert not view.holds("A", b"gone") and view.holds("A", b"fresh")


def test_choose_picks_the_peer_with_longest_run_without_messages():
    view = PeerSummaries()
    ks = keys("p", 6)
    logs = {name: SummaryLog() for name in ("A", "B", "C")}
    for k in ks[:2]:
        logs["A"].record(k, True)
    for k in ks[:5]:
        logs["B"].record(k, True)
    logs["C"].record(ks[1], True)
    for name, log in logs.items():
        pull(log, view, name)
    assert view.choose(ks) == ("B", 5)
    assert view.choose(ks, exclude=["B"]) == ("A", 2)
    assert view.choose(ks[1:2]) in (("A", 1), ("B", 1), ("C", 1))
    assert view.choose(keys("nobody", 3)) == (None, 0)


def test_choose_cost_does_not_grow_with_peer_count():
    # The answer is one peer whatever the pool size: one lookup message per request.
    view = PeerSummaries()
    ks = keys("q", 4)
    for i in range(50):
        log = SummaryLog()
        for k in ks[: (i % 4) + 1]:
            log.record(k, True)
        pull(log, view, f"peer-{i}")
    peer, n = view.choose(ks)
    assert peer is not None and n == 4


def test_forgotten_peer_is_no_longer_chosen():
    view, log = PeerSummaries(), SummaryLog()
    log.record(b"k", True)
    pull(log, view, "A")
    view.forget("A")
    assert view.choose([b"k"]) == (None, 0)


def test_duplicate_record_counts_are_balanced():
    log = SummaryLog()
    log.record(b"k", True)
    log.record(b"k", True)
    log.record(b"k", False)
    assert len(log) == 1
    log.record(b"k", False)
    log.record(b"k", False)
    assert len(log) == 0


@pytest.mark.parametrize("bad", [
    None, 5, "***", pack_digests([b"1234567"]),
])
def test_malformed_digest_lists_are_refused(bad):
    with pytest.raises(ValueError):
        unpack_digests(bad)


@pytest.mark.parametrize("bad", [
    [], {"epoch": "", "seq": 0, "reset": True, "added": "", "removed": ""},
    {"epoch": "e", "seq": -1, "reset": True, "added": "", "removed": ""},
    {"epoch": "e", "seq": 1, "reset": "yes", "added": "", "removed": ""},
    {"epoch": "e", "seq": True, "reset": True, "added": "", "removed": ""},
])
def test_malformed_summary_replies_are_refused(bad):
    with pytest.raises(ValueError):
        SummaryDelta.from_dict(bad)


# A peer's summary reply is input from another pod: whatever JSON it sends, the puller
# either applies a valid delta or refuses it with a ValueError (the link then backs off).


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
_field = st.one_of(_json, st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
                   st.integers(-3, 2 ** 70), st.text(max_size=80))


@settings(max_examples=400, deadline=None)
@given(st.one_of(_json, st.fixed_dictionaries({}, optional={k: _field for k in
                                                            ("epoch", "seq", "reset", "added", "removed")})))
def test_a_peers_summary_reply_is_applied_or_refused_with_a_value_error(reply):
    try:
        delta = SummaryDelta.from_dict(reply)
    except ValueError:
        return
    summaries = PeerSummaries()
    summaries.apply("peer", delta)
    assert summaries.cursor("peer") == (delta.epoch, delta.seq)
    assert all(len(d) == 8 for d in delta.added + delta.removed)
