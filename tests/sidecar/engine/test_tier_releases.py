"""DeferredReleases: a failed load's release event is set once its sidecar's answer (or the
connection's end) arrives, and release_all sets every event within its wait."""

from __future__ import annotations

import socket
import time

from kv_offload_sidecar.engine.tier_releases import DeferredReleases


class Conn:
    """A LocalConn's shape: ``sock`` and ``close``; the other end plays the sidecar."""

    def __init__(self) -> None:
        self.sock, self.sidecar = socket.socketpair()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def test_the_event_is_set_by_the_late_answer_and_not_before():
    releases = DeferredReleases()
    try:
        conn = Conn()
        event = releases.defer(conn)
        assert not event.wait(0.2) and releases.pending == 1
        conn.sidecar.sendall(b"\x00\x00\x00\x0c{\"ok\":true}")  # the answer, at last
        assert event.wait(10.0)
        assert conn.closed and releases.pending == 0 and releases.forced == 0
    finally:
        releases.close()


def test_the_end_of_the_connection_sets_the_event():
    releases = DeferredReleases()
    try:
        conn = Conn()
        event = releases.defer(conn)
        conn.sidecar.close()  # the sidecar process is gone, and its mapping of the rows
        assert event.wait(10.0) and releases.forced == 0
    finally:
        releases.close()


def test_release_all_waits_for_answers_then_sets_the_rest_within_its_wait():
    releases = DeferredReleases()
    try:
        answered, stalled = Conn(), Conn()
        first, second = releases.defer(answered), releases.defer(stalled)
        answered.sidecar.sendall(b"x")
        t0 = time.monotonic()
        releases.release_all(0.3)
        assert time.monotonic() - t0 < 2.0
        assert first.is_set() and second.is_set() and releases.pending == 0
        assert releases.forced == 1 and stalled.closed
    finally:
        releases.close()


def test_after_close_a_deferral_is_released_at_once():
    releases = DeferredReleases()
    releases.close()
    conn = Conn()
    assert releases.defer(conn).is_set() and conn.closed
