"""The asker's fetched copies: taken once by the load that uses them, let go by age, bounded."""

from __future__ import annotations

from types import SimpleNamespace

from kv_offload_sidecar.peers import fetched_copies
from kv_offload_sidecar.peers.fetched_copies import FetchedCopies
from sidecar_support import Clock


def test_a_load_takes_only_the_fetched_keys_and_only_once():
    copies = FetchedCopies()
    copies.remember([b"a", b"b", b"c"])
    copies.forget([b"c"])  # its holder's count said it is not coming
    assert copies.take([b"a", b"x", b"c"]) == [b"a"]
    assert copies.take([b"a"]) == [] and len(copies) == 1


def test_copies_no_load_took_are_let_go_oldest_first_by_age(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(fetched_copies, "time", SimpleNamespace(monotonic=clock))
    copies = FetchedCopies()
    copies.remember([b"old"])
    clock.now += 5.0
    copies.remember([b"new", b"old"])  # asked again: as young as the newest
    clock.now += 5.0
    assert copies.take_older_than(7.0) == [] and len(copies) == 2
    clock.now += 3.0
    assert sorted(copies.take_older_than(7.0)) == [b"new", b"old"]


def test_past_the_bound_the_oldest_are_forgotten(monkeypatch):
    monkeypatch.setattr(fetched_copies, "MAX_FETCHED", 3)
    copies = FetchedCopies()
    copies.remember([b"1", b"2", b"3", b"4"])
    assert len(copies) == 3 and copies.take([b"1", b"4"]) == [b"4"]
