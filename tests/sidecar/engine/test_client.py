"""EngineClient against a real sidecar process: store, lookup, load through shared memory."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import threading
import time

import pytest
from kv_offload_testing.frozen import freeze
from kv_offload_sidecar.engine.client import (
    EngineClient,
    LookupReply,
    SidecarUnavailable,
)
from kv_offload_testing.local_pool import LocalPool, free_port_block
from sidecar_support import new_keys, read_chunks, write_chunks
from waiting import wait_for


@pytest.fixture(scope="module")
def pool():
    # One sidecar serving global DP indices 2 and 3 (ports base+2, base+3); 64 slots.
    with LocalPool(1, dp_indices=(2, 3), capacity_bytes=64 * 16384) as p:
        yield p


@pytest.fixture
def client(pool):
    c = pool.client(0)
    yield c
    c.close()


def test_store_then_load_is_byte_identical(client):
    keys = new_keys(4)
    data = write_chunks(client, keys)
    assert client.lookup(keys) == LookupReply(local=4, peer=0)
    assert read_chunks(client, keys) == [data[k] for k in keys]


def test_lookup_says_when_the_sidecar_knew_the_answer_on_the_engines_monotonic_clock(client):
    keys = new_keys(2)
    write_chunks(client, keys)
    asked = time.monotonic()
    reply = client.lookup(keys)
    answered = time.monotonic()
    assert reply.hits == 2 and asked <= reply.known_at <= answered
    assert client.lookup(keys, timeout=-1).known_at is None  # refused: no answer, no time


def test_a_cancelled_load_hands_out_no_slot(client):
    keys = new_keys(2)
    data = write_chunks(client, keys)
    assert client.cancel(["engine-x:1"]) == 0  # before its request: remembered
    assert client.load(keys, lambda i, v: None, timeout=60.0, job="engine-x:1") == 0
    assert read_chunks(client, keys) == [data[k] for k in keys]  # nothing left pinned or lost


def test_lookup_and_load_stop_at_the_first_missing_key(client):
    keys = new_keys(3)
    write_chunks(client, keys[:2])
    probe = keys[:2] + new_keys(1) + keys[2:]
    assert client.lookup(probe) == LookupReply(2, 0)
    assert len(read_chunks(client, probe)) == 2


def test_storing_held_keys_skips_them(client):
    keys = new_keys(2)
    write_chunks(client, keys)
    called = []
    assert client.store(keys, lambda i, v: called.append(i)) == 0
    assert called == []


def test_failing_write_fn_propagates_and_stores_nothing(client):
    keys = new_keys(3)

    def write(i: int, view: memoryview) -> None:
        if i == 1:
            raise RuntimeError("engine copy failed")
        view[:] = b"\1" * len(view)

    with pytest.raises(RuntimeError, match="engine copy failed"):
        client.store(keys, write)
    assert client.lookup(keys) == LookupReply(0, 0)
    assert client.store(keys, lambda i, v: None) == 3  # nothing was left reserved


def test_failing_read_fn_propagates_and_releases_pins(pool, client):
    keys = new_keys(2)
    write_chunks(client, keys)
    with pytest.raises(ValueError, match="engine read failed"):
        client.load(keys, lambda i, v: (_ for _ in ()).throw(ValueError("engine read failed")))
    # Pins were released: filling the store several times over evicts these chunks.
    for _ in range(3):
        write_chunks(client, new_keys(60))
    assert client.lookup(keys) == LookupReply(0, 0)


def test_other_dp_port_shares_the_same_store(pool, client):
    other = pool.client(0, dp_index=3)
    try:
        keys = new_keys(2)
        data = write_chunks(other, keys)
        assert read_chunks(client, keys) == [data[k] for k in keys]
        assert other.socket_path != client.socket_path
    finally:
        other.close()


def test_from_env_uses_side_channel_host_and_port_plus_dp_index(pool):
    sc = pool[0]
    env = {"VLLM_P2P_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_P2P_SIDE_CHANNEL_PORT": str(sc.base_port)}
    c = EngineClient.from_env(dp_index=3, environ=env)
    try:
        assert c.socket_path.endswith("-dp3.sock")
    finally:
        c.close()


def test_threads_share_one_client(client):
    keys = [new_keys(3) for _ in range(6)]
    errors: list[BaseException] = []

    def work(ks: list[bytes]) -> None:
        try:
            data = write_chunks(client, ks)
            assert read_chunks(client, ks) == [data[k] for k in ks]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(ks,)) for ks in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []


def test_unreachable_sidecar_is_a_clear_error():
    port = free_port_block(1)
    with pytest.raises(SidecarUnavailable, match=f"127.0.0.1:{port}.*VLLM_P2P_SIDE_CHANNEL"):
        EngineClient.connect("127.0.0.1", port, timeout=2.0)


@contextlib.contextmanager
def stopped(pool):
    """The sidecar process frozen (SIGSTOP) for the block: it reads and answers nothing."""
    pid = pool[0].proc.pid
    freeze(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_late_answer_is_a_miss(pool, client):
    keys = new_keys(1)
    write_chunks(client, keys)
    with stopped(pool):
        assert client.lookup(keys, timeout=0.2) == LookupReply(0, 0)
        assert client.load(keys, lambda i, v: None, timeout=0.2) == 0
    assert client.timeouts == 2
    assert client.lookup(keys) == LookupReply(1, 0)


def test_a_started_lookup_is_read_later_without_blocking_on_the_thread_that_polls(pool, client):
    keys = new_keys(2)
    write_chunks(client, keys)
    with stopped(pool):
        pending = client.lookup_start(keys, timeout=60.0)
        assert pending.poll() is None and not pending.ready()  # asked, not answered: no wait
    wait_for("the sidecar's answer in the socket", pending.ready)
    reply = pending.poll()
    assert reply == LookupReply(2, 0) and reply.known_at is not None
    assert pending.poll() is reply
    assert client.lookup(keys) == LookupReply(2, 0)  # its connection went back to the pool


def _raw(path: str, payload: bytes, length: int | None = None) -> dict | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(struct.pack("!I", len(payload) if length is None else length) + payload)
    head = s.recv(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("!I", head)
    buf = b""
    while len(buf) < n:
        buf += s.recv(n - len(buf))
    reply = json.loads(buf)
    assert s.recv(1) == b""  # the sidecar closed the connection
    s.close()
    return reply


@pytest.mark.parametrize("payload, length, phrase", [
    (b"{nope", None, "not JSON"),
    (b"[1, 2]", None, "'op'"),
    (b"", 1 << 30, "exceeds"),
])
def test_malformed_local_frames_get_an_error_and_a_closed_connection(client, payload, length, phrase):
    reply = _raw(client.socket_path, payload, length)
    assert reply is not None and reply["ok"] is False and phrase in reply["error"]
    assert client.lookup(new_keys(1)) == LookupReply(0, 0)
    assert client.errors == 0


def test_bad_requests_on_the_local_channel_are_answered(client):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(client.socket_path)
    try:
        for req, phrase in (({"op": "fly"}, "unknown op"), ({"op": "lookup", "keys": ["zz"]}, "keys[0]"),
                            ({"op": "release", "id": 99}, "unknown load id"),
                            ({"op": "commit", "id": "x"}, "'id'")):
            data = json.dumps(req).encode()
            s.sendall(struct.pack("!I", len(data)) + data)
            (n,) = struct.unpack("!I", s.recv(4))
            reply = json.loads(s.recv(n))
            assert reply["ok"] is False and phrase in reply["error"]
    finally:
        s.close()


def test_dead_sidecar_makes_calls_misses_not_crashes():
    with LocalPool(1) as p:
        c = p.client(0)
        keys = new_keys(1)
        write_chunks(c, keys)
        p[0].kill()
        assert c.lookup(keys) == LookupReply(0, 0)
        assert c.store(keys, lambda i, v: None) == 0
        assert c.load(keys, lambda i, v: None) == 0
        assert c.errors == 3
        c.close()


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_client_reattaches_to_a_restarted_sidecar_without_writing_into_the_old_store(kill, caplog):
    caplog.set_level(logging.INFO, logger="kv_offload_sidecar.engine.client")
    with LocalPool(1) as p:
        c = p.client(0)
        old_instance = c.instance
        keys = new_keys(2)
        write_chunks(c, keys)
        stopped_at = time.monotonic()
        p.restart(0, kill=kill)
        # The client finds its sidecar gone when the connection it holds to it ends.
        wait_for("the client to find its sidecar gone", lambda: not c.attached_now)
        assert c.reattach_seconds is None

        def reattached() -> bool:
            if c.instance == old_instance:
                c.lookup(keys)  # a call is what re-attaches a stale client
            return c.instance != old_instance

        wait_for("the client re-attached to the restarted sidecar", reattached)
        assert c.instance != old_instance and c.reattaches == 1
        # How long storing was off is known and logged: from finding the sidecar gone to the
        # re-attachment, both within the restart and this wait.
        assert 0 < c.reattach_seconds <= time.monotonic() - stopped_at
        assert any("re-attached its store" in r.getMessage() and "after it was found gone"
                   in r.getMessage() for r in caplog.records)
        fresh = new_keys(3)
        data = write_chunks(c, fresh)
        other = p.client(0)
        try:
            assert read_chunks(other, fresh) == [data[k] for k in fresh]
        finally:
            other.close()
        c.close()


def test_request_naming_another_instance_is_refused_as_stale(client):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(client.socket_path)
    try:
        data = json.dumps({"op": "reserve", "keys": [new_keys(1)[0].hex()], "instance": "old"}).encode()
        s.sendall(struct.pack("!I", len(data)) + data)
        (n,) = struct.unpack("!I", s.recv(4))
        reply = json.loads(s.recv(n))
        assert reply["ok"] is False and reply["stale"] is True and "re-attach" in reply["error"]
    finally:
        s.close()
