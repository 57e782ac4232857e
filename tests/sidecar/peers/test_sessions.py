"""Inbound sessions: bounded, and sessions of a retired key end after the grace."""

from __future__ import annotations

from types import SimpleNamespace

from kv_offload_sidecar.peers import sessions
from kv_offload_sidecar.peers.handshake import Session, make_hello
from kv_offload_sidecar.peers.sessions import InboundSessions

HELLO = make_hello(fingerprint="f" * 16, hash_seed="0", kv_bytes_per_chunk=1, identity="p",
                   control_address="h:1", data_address="tcp://h:2", transport="tcp")


def session(n: int, kid: bytes = b"k1") -> Session:
    return Session(bytes([n]) * 16, b"s" * 32, HELLO, "inbound", kid)


def test_oldest_sessions_are_dropped_beyond_the_limit():
    table = InboundSessions(limit=2)
    for n in range(3):
        table.add(session(n))
    assert table.get(bytes([0]) * 16) is None and table.get(bytes([2]) * 16) is not None
    assert len(table) == 2


def test_sessions_of_a_retired_key_work_through_the_grace_then_end(monkeypatch):
    now = [100.0]  # the grace runs on a clock the test moves, not on how fast the machine is
    monkeypatch.setattr(sessions, "time", SimpleNamespace(monotonic=lambda: now[0]))
    table = InboundSessions()
    table.add(session(1, b"old"))
    table.add(session(2, b"new"))
    assert table.retire([b"old"], grace_seconds=0.2) == 1
    now[0] += 0.19
    assert table.get(bytes([1]) * 16) is not None
    now[0] += 0.02
    assert table.get(bytes([1]) * 16) is None
    assert table.get(bytes([2]) * 16) is not None
    assert table.counts_by_key() == {b"new".hex(): 1}
