"""The pool's core behaviour, with real sidecar processes on 127.0.0.1.

Three sidecars share chunks over tcp and ucx; mismatching peers are rejected and
get nothing; bad bodies and frames are refused while service continues; a peer
killed mid-fetch is a miss; the store stays within budget.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import pytest
from kv_offload_testing.frozen import freeze
from kv_offload_sidecar.engine.client import LookupReply
from kv_offload_sidecar.peers.handshake import (
    HandshakeInitiator,
    HelloMessage,
    client_proof,
    make_hello,
    transcript,
)
from kv_offload_testing.local_pool import LocalPool, SidecarOverride, example_config
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY
from sidecar_support import new_keys, read_chunks, write_chunks
from waiting import SAFETY_SECONDS, wait_for

CHUNK = example_config().kv_bytes_per_chunk
HANDSHAKES = "kv_offload_handshakes_total"


@pytest.fixture(scope="module")
def pool():
    # 256 slots of 16 KiB per sidecar.
    with LocalPool(3, capacity_bytes=256 * CHUNK, fetch_deadline_seconds=3.0) as p:
        yield p


@pytest.mark.parametrize("transport, lanes", [("tcp", None), ("ucx", 1), ("ucx", 2)],
                         ids=["tcp", "ucx", "ucx-2-lanes"])
def test_chunks_stored_through_a_are_fetched_by_c_byte_identical(transport, lanes):
    extra = () if lanes is None else ("--lanes", str(lanes))
    with LocalPool(3, transport=transport, capacity_bytes=256 * CHUNK, extra_args=extra) as pool:
        a, c = pool.client(0), pool.client(2)
        keys = new_keys(8)
        data = write_chunks(a, keys)
        pool.wait_directory_current()
        messages_before = pool[2].metric("kv_offload_lookup_messages_total")
        assert c.lookup(keys) == LookupReply(local=0, peer=8)
        assert read_chunks(c, keys) == [data[k] for k in keys]
        # C keeps no copy once loaded (the pool keeps one, at A); per engine request one question
        # to the key's directory owner (none when that is C itself) and one exchange with the
        # holder, whatever the number of peers.
        assert pool[2].metric("kv_offload_store_chunks") == 0
        owner_is_remote = pool.owners_of(keys[0])[0] != pool[2].identity
        assert pool[2].metric("kv_offload_lookup_messages_total") - messages_before == 1 + owner_is_remote
        assert pool[2].metric("kv_offload_peer_bytes_total", direction="received") == 8 * CHUNK
        # The holder counts a chunk when its send completes, which it may learn just after the
        # fetcher has the bytes (over UCX: after the fetcher's acknowledgement reaches it).
        wait_for("the holder to count the 8 chunks it sent",
                 lambda: pool[0].metric("kv_offload_peer_bytes_total", direction="sent") == 8 * CHUNK)
        assert pool[1].metric("kv_offload_peer_bytes_total", direction="sent") == 0
        assert pool[2].metric("kv_offload_chunk_lookups_total", result="peer_hit") == 8
        assert pool[2].metric("kv_offload_chunk_lookups_total", result="local_hit") == 0
        assert pool[2].metric("kv_offload_peer_fetch_duration_seconds_count") >= 1
        assert pool[2].status()["transport"] == transport
        assert pool[2].status().get("ucx_lanes") == lanes
        a.close()
        c.close()
        codes = pool.stop()
    assert set(codes.values()) == {0}  # SIGTERM is a graceful exit


def test_peers_stripe_fetches_over_the_fewer_lanes_both_offer_shown_in_status_and_metrics():
    with LocalPool(2, transport="tcp", capacity_bytes=64 * CHUNK, extra_args=("--lanes", "3")) as pool:
        narrow = pool.add(SidecarOverride(extra_args=("--lanes", "2"), joins=True))
        wait_for("each sidecar's link to the other two to be up", lambda: all(
            sum(p["state"] == "connected" for p in sc.peers()) == 2 for sc in pool.members()))
        assert pool[0].status()["data_lanes_offered"] == 3
        # Members hold no data connection until they read from each other (links on demand).
        assert pool[0].status()["data_lanes"] == {} and pool[0].metric("kv_offload_peer_data_lanes") == 0
        a, b, c = pool.client(0), pool.client(1), pool.client(2)
        keys, more = new_keys(12), new_keys(6)
        data = write_chunks(a, keys)
        data_more = write_chunks(b, more)
        pool.wait_directory_current()
        assert c.lookup(keys) == LookupReply(local=0, peer=12)
        assert read_chunks(c, keys) == [data[k] for k in keys]
        assert a.lookup(more) == LookupReply(local=0, peer=6)
        assert read_chunks(a, more) == [data_more[k] for k in more]
        # Each reader's link to its holder carries the fewer lanes both offer.
        assert narrow.status()["data_lanes"] == {pool[0].identity: 2}
        assert pool[0].status()["data_lanes"] == {pool[1].identity: 3}
        assert {p["identity"]: (p["data_open"], p["data_lanes"]) for p in narrow.peers()} == \
            {pool[0].identity: (True, 2), pool[1].identity: (False, 0)}
        assert pool[0].metric("kv_offload_peer_data_lanes") == 3
        assert pool[0].metric("kv_offload_peer_data_links") == 1
        for client in (a, b, c):
            client.close()


@pytest.mark.parametrize("override, reason", [
    (SidecarOverride(config=example_config(tokens_per_hash=32)), "fingerprint_mismatch"),
    (SidecarOverride(pool_key=b"another-pool-key"), "other_pool"),
    (SidecarOverride(hash_seed="12345"), "hash_seed_mismatch"),
    (SidecarOverride(config=example_config(worker_kv_bytes_per_block=8192)), "chunk_size_mismatch"),
], ids=["fingerprint", "pool-key", "hash-seed", "chunk-size"])
def test_mismatching_peer_is_rejected_and_gets_no_chunk(pool, override, reason):
    a = pool.client(0)
    keys = new_keys(4)
    write_chunks(a, keys)
    pool.wait_directory_current()
    before = [s.metric(HANDSHAKES, result="rejected", reason=reason) for s in pool.members()]
    sent_before = pool[0].metric("kv_offload_peer_bytes_total", direction="sent")
    intruder = pool.add(override)
    try:
        # Every member rejects it with that reason, and so does the intruder itself.
        for s, b in zip(pool.members(), before):
            wait_for(f"{s.identity} to count a {reason} rejection",
                     lambda s=s, b=b: s.metric(HANDSHAKES, result="rejected", reason=reason) > b)
        wait_for("intruder rejections", lambda: intruder.metric(HANDSHAKES, result="rejected") >= 3)
        # Its links sit rejected between jittered retries (a retry shows as connecting for its handshake).
        wait_for("intruder's links all rejected",
                 lambda: (peers := intruder.peers()) and all(p["state"] == "rejected" for p in peers))
        assert intruder.metric(HANDSHAKES, result="accepted") == 0
        assert all(intruder.identity not in {p["identity"] for p in s.peers()} for s in pool.members())
        # It receives no chunk byte: its engine sees misses, nothing arrives.
        d = intruder.client()
        try:
            if d.slot_bytes == a.slot_bytes:
                assert d.lookup(keys) == LookupReply(0, 0)
                assert read_chunks(d, keys) == []
        finally:
            d.close()
        assert intruder.metric("kv_offload_peer_bytes_total", direction="received") == 0
        assert intruder.status()["store"]["chunks"] == 0
        assert pool[0].metric("kv_offload_peer_bytes_total", direction="sent") == sent_before
    finally:
        intruder.terminate()
        a.close()


@pytest.mark.parametrize("fingerprint", ["", None], ids=["empty", "missing"])
def test_empty_or_missing_fingerprint_is_rejected(pool, fingerprint):
    cfg = example_config()
    hello = make_hello(fingerprint=fingerprint or "", hash_seed=pool.hash_seed, kv_bytes_per_chunk=CHUNK,
                       identity="intruder", control_address="127.0.0.1:1",
                       data_address="tcp://127.0.0.1:1", transport="tcp", run_config=cfg.run_config(),
                       model_identity=STAND_IN_IDENTITY)
    initiator = HandshakeInitiator(pool.pool_key, hello)
    before = pool[0].metric(HANDSHAKES, result="rejected", reason="fingerprint_mismatch")
    code, reply = pool[0].post("/v1/handshake", initiator.step1())
    assert code == 200
    step2 = initiator.step2(reply)
    if fingerprint is None:  # re-prove the hello without the field, as a broken member would send it
        del step2["hello"]["fingerprint"]
        t = transcript(initiator.nonce, bytes.fromhex(step2["nonce_server"]), bytes.fromhex(reply["key_id"]),
                       HelloMessage.from_dict(step2["hello"]))
        step2["proof"] = client_proof(pool.pool_key, t)
    code, body = pool[0].post("/v1/handshake", step2)
    assert code == 403
    assert body["reason"] == "fingerprint_mismatch" and "fingerprint" in body["fields"]
    assert "proof" not in body and "hello" not in body
    assert pool[0].metric(HANDSHAKES, result="rejected", reason="fingerprint_mismatch") == before + 1


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the peer sends until it closes (or resets, or goes quiet past the timeout)."""
    chunks = []
    while True:
        try:
            part = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not part:
            break
        chunks.append(part)
    return b"".join(chunks)


def _http_raw(port: int, request: bytes, close_early: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        if close_early:
            return b""
        return _read_until_closed(s)


def test_bad_bodies_get_clear_errors_and_sidecar_keeps_serving(pool):
    sc = pool[0]
    code, body = sc.post("/v1/handshake", b"{\"step\": \"hello\", \"hello\": ")
    assert code == 400 and "not valid JSON" in body["error"]
    code, body = sc.post("/v1/handshake", b"x" * (1 << 20))
    assert code == 413 and "exceeds" in body["error"]
    code, body = sc.post("/v1/lookup", {"keys": ["not-hex"]})
    assert code == 400 and "keys[0]" in body["error"]
    # A body shorter than its Content-Length, then the client goes away.
    _http_raw(sc.port, b"POST /v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n{\"step\":", close_early=True)
    # A request line that is not HTTP.
    reply = _http_raw(sc.port, b"\x00\x01\x02 garbage\r\n\r\n")
    assert reply.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    _still_serves(pool)


def _data_port(sc) -> int:
    address = sc.status()["data_address"]
    assert address.startswith("tcp://")
    return int(address.rsplit(":", 1)[1])


def _frames_reply(port: int, payload: bytes) -> bytes:
    """Send bytes to a data port; return everything until the sidecar closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        challenge = s.recv(16 + 16)  # AUTH_CHALLENGE header + nonce (may arrive in parts)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return challenge + _read_until_closed(s)


@pytest.mark.parametrize("payload, phrase, counted", [
    (b"XX" + b"\0" * 14, b"malformed", True),
    (struct.pack("!2sBBIQ", b"KO", 1, 2, 0, 1 << 40), b"oversize", True),
    (struct.pack("!2sBBIQ", b"KO", 1, 250, 0, 0), b"unknown_type", True),
    (struct.pack("!2sBBIQ", b"KO", 1, 4, 0, 0), b"", True),  # a request before authenticating
    (b"KO\x01", b"", False),  # a truncated header, then the peer hangs up
], ids=["bad-magic", "oversize-length", "unknown-type", "unauthenticated", "truncated"])
def test_malformed_data_frames_are_refused_and_sidecar_keeps_serving(pool, payload, phrase, counted):
    sc = pool[0]
    errors_before = sc.metric("kv_offload_protocol_errors_total")
    reply = _frames_reply(_data_port(sc), payload)
    assert reply[:2] == b"KO"  # the challenge came first
    assert phrase in reply
    if counted:
        wait_for("the protocol error to be counted",
                 lambda: sc.metric("kv_offload_protocol_errors_total") > errors_before)
    _still_serves(pool)


def _still_serves(pool):
    a, c = pool.client(0), pool.client(2)
    try:
        keys = new_keys(2)
        data = write_chunks(a, keys)
        pool.wait_directory_current()
        assert read_chunks(c, keys) == [data[k] for k in keys]
    finally:
        a.close()
        c.close()


def test_store_stays_within_budget_under_sustained_writes(pool):
    sc = pool[1]
    b = pool.client(1)
    try:
        capacity = sc.metric("kv_offload_store_capacity_bytes")
        slots = sc.status()["store"]["num_slots"]
        assert 0 < capacity <= pool.capacity_bytes
        path = sc.status()["store"]["path"]
        size = os.path.getsize(path)
        last: dict[bytes, bytes] = {}
        for _ in range(5):  # five times the store's size
            for _ in range(slots // 64):
                keys = new_keys(64)
                last = write_chunks(b, keys)
                assert sc.metric("kv_offload_store_used_bytes") <= capacity
        assert sc.metric("kv_offload_store_chunks") <= slots
        assert sc.metric("kv_offload_evictions_total") >= 4 * slots - 64
        assert os.path.getsize(path) == size <= pool.capacity_bytes
        keys = list(last)
        assert read_chunks(b, keys) == [last[k] for k in keys]  # the newest chunks are whole
    finally:
        b.close()


def test_peer_killed_mid_fetch_is_a_miss_and_nothing_partial_is_stored():
    with LocalPool(3, capacity_bytes=256 * CHUNK, fetch_deadline_seconds=3.0) as pool:
        a, b, c = pool.client(0), pool.client(1), pool.client(2)
        keys_a, keys_b = new_keys(32), new_keys(4)
        write_chunks(a, keys_a)
        data_b = write_chunks(b, keys_b)
        pool.wait_directory_current()
        assert pool[2].hits(keys_a) == 32  # the admin lookup: nothing moves yet
        victim = pool[0].proc
        freeze(victim.pid)  # the fetch request will be in flight when it dies
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(c.load(keys_a, lambda i, v: None, timeout=3.0)))
        t.start()
        wait_for("C to be loading from the stopped holder",
                 lambda: pool[2].status()["engine_requests_in_flight"] == 1)
        victim.kill()
        t.join(SAFETY_SECONDS)
        assert result == [0]
        assert c.timeouts == 0 and c.errors == 0  # the sidecar answered the miss itself, in time
        status = pool[2].status()
        assert status["store"]["chunks"] == 0 and status["store"]["used_bytes"] == 0
        assert c.lookup(keys_a) == LookupReply(0, 0)
        assert pool[2].metric("kv_offload_peer_fetches_total", result="ok") == 0
        # The pool keeps serving: B's chunks still reach C (their directory entries moved on
        # from A within a publish interval).
        pool.wait_directory_current()
        assert read_chunks(c, keys_b) == [data_b[k] for k in keys_b]
        for cl in (a, b, c):
            cl.close()


def _lookup_fetching_from_the_stopped_holder(pool: LocalPool, client, keys: list[bytes]
                                             ) -> tuple[threading.Thread, list[LookupReply]]:
    """Sidecar 1's lookup of ``keys`` on a thread, returned once its fetch is in flight."""
    result: list[LookupReply] = []
    t = threading.Thread(target=lambda: result.append(client.lookup(keys, timeout=5.0)))
    t.start()
    wait_for("B's lookup to fetch from the stopped holder",
             lambda: pool[1].status()["peer_fetches_in_flight"] == 1)
    return t, result


def test_a_lookups_fetch_shows_in_flight_until_its_exchange_ends():
    # The stalled fetch shows for its whole deadline: seconds, against 50 ms between probes.
    with LocalPool(2, capacity_bytes=256 * CHUNK, fetch_deadline_seconds=3.0) as pool:
        a, b = pool.client(0), pool.client(1)
        # Keys whose location B keeps itself: locating them does not ask the stopped holder.
        landed, stalled = new_keys(4), [k for k in new_keys(64)
                                        if pool.owners_of(k)[0] == pool[1].identity][:4]
        write_chunks(a, landed + stalled)
        pool.wait_directory_current()
        assert b.lookup(landed) == LookupReply(0, 4)  # the count; the chunks follow
        wait_for("B's fetch to land", lambda: pool[1].status()["store"]["chunks"] == 4)
        wait_for("B's fetch to end", lambda: pool[1].status()["peer_fetches_in_flight"] == 0)
        holder = pool[0].proc

        def given_up() -> dict[str, float]:
            return {r: pool[1].metric("kv_offload_peer_answers_given_up_total", reason=r)
                    for r in ("silence", "deadline")}

        before = given_up()
        freeze(holder.pid)  # the holder never answers the next one
        try:
            t, result = _lookup_fetching_from_the_stopped_holder(pool, b, stalled)
            t.join(SAFETY_SECONDS)
            assert result == [LookupReply(0, 0)]  # the holder silent: a miss
            # The lookup gave up on the holder's count, once (silent for its answer silence, or
            # at the deadline where that silence grew as long), and says so in the metrics.
            after = given_up()
            print(f"\n[given up] {after} (before {before})")
            assert sum(after.values()) - sum(before.values()) == 1
            wait_for("the stalled fetch to end at its deadline",
                     lambda: pool[1].status()["peer_fetches_in_flight"] == 0)
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        a.close()
        b.close()


# How long the holder is stopped while the asker opens its first data link to it: well past
# OPEN_ROUND_TRIPS answer silences at a loopback round trip (4 x 50 ms), well within the deadlines.
SLOW_OPEN_SECONDS = 1.0


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_a_holder_slow_to_let_the_first_data_link_open_still_answers_the_lookup_with_a_hit(transport: str):
    # A loaded host: the holder cannot run while B opens its first data link to it. The open's
    # own bound (the handshake timeout) judges the holder then, not the answer silence, so
    # B's lookup waits for the count and hits instead of giving up after 4 silences. Its
    # kernel still accepts connections: tcp's own, and the one a UCX open dials to its
    # control port to learn that it reached the host.
    with LocalPool(2, transport=transport, capacity_bytes=256 * CHUNK, fetch_deadline_seconds=3.0) as pool:
        a, b = pool.client(0), pool.client(1)
        # Keys whose location B keeps itself: locating them does not ask the stopped holder.
        keys = [k for k in new_keys(64) if pool.owners_of(k)[0] == pool[1].identity][:4]
        write_chunks(a, keys)
        pool.wait_directory_current()
        assert not any(p["data_open"] for p in pool[1].peers())  # the first exchange opens it
        given_up = pool[1].metric("kv_offload_peer_answers_given_up_total", reason="silence")
        holder = pool[0].proc
        freeze(holder.pid)
        try:
            t, result = _lookup_fetching_from_the_stopped_holder(pool, b, keys)
            time.sleep(SLOW_OPEN_SECONDS)
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        t.join(SAFETY_SECONDS)
        assert result == [LookupReply(0, 4)]
        assert pool[1].metric("kv_offload_peer_answers_given_up_total", reason="silence") == given_up
        assert any(p["data_open"] for p in pool[1].peers())
        a.close()
        b.close()


def test_a_fetch_that_missed_its_deadline_while_the_fetcher_itself_was_stopped_does_not_back_the_holder_off():
    # Seconds B's exchange may take: far longer than the probe that sees it begin and the stop after.
    deadline = 3.0
    with LocalPool(2, capacity_bytes=256 * CHUNK, fetch_deadline_seconds=deadline) as pool:
        a, b = pool.client(0), pool.client(1)
        # Keys whose location B keeps itself: B's only message is the exchange with the holder.
        keys = [k for k in new_keys(64) if pool.owners_of(k)[0] == pool[1].identity]
        warm, stalled, later = keys[:2], keys[2:6], keys[6:10]
        write_chunks(a, warm + stalled + later)
        pool.wait_directory_current()
        # A first read opens B's data link to the holder (links open on demand): the exchange
        # below runs on it.
        assert b.lookup(warm) == LookupReply(0, 2)
        wait_for("B's fetch to end", lambda: pool[1].status()["peer_fetches_in_flight"] == 0)
        holder, fetcher = pool[0].proc, pool[1].proc
        exchanges = pool[1].metric("kv_offload_lookup_messages_total")
        freeze(holder.pid)  # the exchange waits on the holder...
        try:
            result: list[LookupReply] = []
            t = threading.Thread(target=lambda: result.append(b.lookup(stalled, timeout=3 * deadline)))
            t.start()
            wait_for("B's exchange with the stopped holder to begin",
                     lambda: pool[1].metric("kv_offload_lookup_messages_total") == exchanges + 1)
            freeze(fetcher.pid)  # ...and its deadline passes while B itself is stopped
            time.sleep(deadline + 0.5)
            os.kill(fetcher.pid, signal.SIGCONT)
            t.join(SAFETY_SECONDS)
            assert result == [LookupReply(0, 0)]  # past the deadline: a miss
            stalls = wait_for("B to see its own stall excuse the failed exchange",
                              lambda: (st := pool[1].status()["loop_stalls"])["peer_failures_excused"] and st)
            assert stalls["count"] >= 1 and stalls["longest_seconds"] >= 1.0
            # The data connection closed at the deadline; the link redials at once, without a failure
            # counted (the holder, still stopped, has not answered the handshake yet).
            link = wait_for("B's link to redial the holder", lambda: next(
                (p for p in pool[1].peers() if p["identity"] == pool[0].identity and p["state"] == "connecting"),
                None))
            assert link["failures"] == 0 and link["last_error"].startswith("fetch")
        finally:
            os.kill(holder.pid, signal.SIGCONT)
            os.kill(fetcher.pid, signal.SIGCONT)
        wait_for("B's link to the holder to connect again",
                 lambda: pool[1].metric("kv_offload_peers", state="connected") == 1)
        pool.wait_directory_current()  # the holder's entries, dropped while it was not a member
        assert b.lookup(later) == LookupReply(0, 4)
        a.close()
        b.close()


def test_peer_joining_at_runtime_is_dialled_back_and_a_leaving_peer_is_a_miss():
    with LocalPool(2, capacity_bytes=256 * CHUNK) as pool:
        newcomer = pool.add()  # only it knows the others; they learn of it from its handshake
        joined = newcomer.client()
        a = pool.client(0)
        keys = new_keys(4)
        data = write_chunks(joined, keys)
        pool.wait_directory_current()
        assert read_chunks(a, keys) == [data[k] for k in keys]
        later = new_keys(2)
        write_chunks(joined, later)
        pool.wait_directory_current()
        joined.close()
        assert newcomer.terminate() == 0
        wait_for("the leaver to be dropped", lambda: all(p["state"] != "connected" for p in pool[0].peers()
                                                          if p["identity"] == newcomer.identity))
        assert a.lookup(later) == LookupReply(0, 0)
        assert pool[0].metric("kv_offload_peers", state="connected") == 1
        assert a.timeouts == 0
        a.close()


def test_sigterm_lets_an_in_flight_load_finish_then_exits_cleanly():
    with LocalPool(2, capacity_bytes=256 * CHUNK, fetch_deadline_seconds=1.0,
                   shutdown_grace_seconds=4.0) as pool:
        a, b = pool.client(0), pool.client(1)
        keys = new_keys(4)
        write_chunks(a, keys)
        pool.wait_directory_current()
        holder = pool[0].proc
        freeze(holder.pid)  # B's fetch will wait for its deadline
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(b.load(keys, lambda i, v: None, timeout=5.0)))
        t.start()
        wait_for("B to be loading from the stopped holder",
                 lambda: pool[1].status()["engine_requests_in_flight"] == 1)
        store_path = pool[1].status()["store"]["path"]
        pool[1].proc.send_signal(signal.SIGTERM)
        t.join(20)
        os.kill(holder.pid, signal.SIGCONT)
        assert result == [0] and b.errors == 0 and b.timeouts == 0  # answered, not cut off
        assert pool[1].proc.wait(20) == 0
        assert not os.path.exists(store_path)
        a.close()
        b.close()
