"""Strangers on the TCP data port (and on NIXL's, the same server): what a connection may cost
before it proves a session. A frame limit, one deadline, places per address and in all, every
refusal counted and its log line summarised. Run against chunk servers in their own processes;
the strangers are raw sockets from several 127.0.0.x source addresses."""

from __future__ import annotations

import random
import select
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kv_offload_sidecar.data import connect
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.before_auth import (
    MAX_UNPROVEN_CONNECTIONS,
    MAX_UNPROVEN_PER_SOURCE,
)
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_testing.certs import pool_certificates
from peer_processes import PeerProcess
from raw_wire import authenticated, error_text, read_until_closed, recv_exact
from raw_wire import dial as stranger
from transport_peers import SESSION_ID, SESSION_KEY, key_of
from waiting import wait_until

CHUNK = 256 * 1024


# ------------------------------------------------------------------ raw strangers


def read_challenge(sock: socket.socket) -> bytes:
    """The server's nonce: it admitted the connection."""
    header = proto.decode_header(recv_exact(sock, proto.HEADER_BYTES))
    assert header.type is proto.MessageType.AUTH_CHALLENGE, header
    return recv_exact(sock, header.length)


def vm_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak RSS) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


# ------------------------------------------------------------------ the frame limit


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_auth_frames_announcing_1_mib_are_refused_at_the_header_and_never_allocated(
        kind: str, start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer(kind, chunks=4, chunk_bytes=CHUNK)
    rss_before, peak_before = vm_kib(peer.pid, "VmRSS"), vm_kib(peer.pid, "VmHWM")
    socks = []
    for i in range(200):  # 25 addresses, 8 connections each; every one stays open on our side
        sock = stranger(peer.address, f"127.0.0.{2 + i % 25}")
        read_challenge(sock)
        sock.sendall(proto.encode_header(proto.MessageType.AUTH_RESPONSE, 0, 1 << 20) + bytes(100))
        socks.append(sock)
    wait_until("200 refused at the header and closed", peer.metrics,
               lambda m: m["protocol_errors"]["oversize"] == 200 and m["unauthenticated"] == 0)
    # Each 1 MiB payload allocated and awaited (as before this limit) would be 200 MiB at peak.
    assert vm_kib(peer.pid, "VmHWM") - peak_before < 16 * 1024
    for sock in socks:
        text = error_text(read_until_closed(sock))
        sock.close()
        assert text.startswith("oversize:") and "before authentication" in text, text
    wait_until("the strangers' memory handed back", peer.metrics, lambda m: m["memory_reclaims"] >= 1)
    assert vm_kib(peer.pid, "VmRSS") - rss_before < 8 * 1024
    assert peer.metrics()["protocol_errors"]["oversize"] == 200


def test_the_longest_valid_proof_fits_the_limit_and_one_byte_more_is_refused(
        start_peer: Callable[..., PeerProcess]) -> None:
    longest = proto.encode_auth_response(b"s" * proto.MAX_SESSION_ID_BYTES, bytes(proto.PROOF_BYTES))
    assert sum(map(len, longest[1:])) == proto.MAX_UNAUTHENTICATED_PAYLOAD
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK)
    sock = stranger(peer.address)
    read_challenge(sock)
    sock.sendall(proto.join(longest))  # read whole, then refused for its (unknown) session
    assert error_text(read_until_closed(sock)).startswith("unauthenticated:")
    sock = stranger(peer.address)
    read_challenge(sock)
    sock.sendall(proto.encode_header(proto.MessageType.AUTH_RESPONSE, 0,
                                     proto.MAX_UNAUTHENTICATED_PAYLOAD + 1))
    assert error_text(read_until_closed(sock)).startswith("oversize:")
    errors = peer.metrics()["protocol_errors"]
    assert (errors["unauthenticated"], errors["oversize"]) == (1, 1)


# ------------------------------------------------------------------ the deadline


def test_a_stranger_that_stalls_or_drips_before_its_proof_is_cut_at_the_deadline(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK, auth_timeout=1.0)
    proof = proto.join(proto.encode_auth_response(SESSION_ID, bytes(proto.PROOF_BYTES)))
    stalled = {"silent": b"", "half a header": proof[:8], "half a proof": proof[:-5]}
    socks = {}
    t0 = time.monotonic()
    for name, sent in stalled.items():
        socks[name] = sock = stranger(peer.address)
        read_challenge(sock)
        sock.sendall(sent)
    dripper = stranger(peer.address)
    read_challenge(dripper)
    dripped = 0
    for byte in proof:  # one byte every 0.2 s: the whole proof would take 12 s
        try:
            dripper.send(bytes([byte]))
        except OSError:
            break
        dripped += 1
        readable, _, _ = select.select([dripper], [], [], 0.2)
        if readable and read_until_closed(dripper) == b"":
            break
    for name, sock in socks.items():
        assert read_until_closed(sock) == b"", name  # cut without a word
        sock.close()
    dripper.close()
    assert dripped < len(proof)
    assert time.monotonic() - t0 < 5  # the 1 s deadline, not the 12 s drip
    m = wait_until("every stalled connection closed", peer.metrics, lambda m: m["unauthenticated"] == 0)
    assert m["protocol_errors"]["timeout"] == 4


def test_strangers_that_never_finish_the_tls_handshake_are_capped_cut_and_their_memory_handed_back(
        start_peer: Callable[..., PeerProcess], tmp_path: Path) -> None:
    certs = pool_certificates(tmp_path, ["server"])["server"]
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK, auth_timeout=3.0, certs=certs)
    plain = "tcp://" + peer.address.removeprefix("tls://")
    rss_before, peak_before = vm_kib(peer.pid, "VmRSS"), vm_kib(peer.pid, "VmHWM")
    per, total = MAX_UNPROVEN_PER_SOURCE, MAX_UNPROVEN_CONNECTIONS
    held = [stranger(plain, f"127.0.0.{2 + i // per}") for i in range(total)]  # no ClientHello
    wait_until("every silent TLS connection admitted", peer.metrics,
               lambda m: m["unauthenticated"] == total)
    newcomer = stranger(plain, f"127.0.0.{3 + total // per}")  # takes the oldest one's place
    assert read_until_closed(held[0]) == b""  # closed for it: no TLS, so no ERROR frame
    assert read_until_closed(newcomer) == b""  # then cut at the deadline like the rest
    newcomer.close()
    m = wait_until("the deadline cut them all", peer.metrics, lambda m: m["unauthenticated"] == 0)
    assert m["protocol_errors"]["timeout"] == total
    assert m["protocol_errors"]["too_many_connections"] == 1
    # asyncio holds 256 KiB per TLS connection in its handshake; the places bound it.
    assert vm_kib(peer.pid, "VmHWM") - peak_before < 32 * 1024
    for sock in held:
        assert read_until_closed(sock) == b""
        sock.close()
    wait_until("the strangers' memory handed back", peer.metrics, lambda m: m["memory_reclaims"] >= 1)
    assert vm_kib(peer.pid, "VmRSS") - rss_before < 8 * 1024


# ------------------------------------------------------------------ places per address and in all


async def test_unauthenticated_connections_per_address_are_capped_and_the_excess_refused_and_counted(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK)
    held = [stranger(peer.address, "127.0.0.2") for _ in range(MAX_UNPROVEN_PER_SOURCE)]
    for sock in held:
        read_challenge(sock)
    assert peer.metrics()["unauthenticated"] == MAX_UNPROVEN_PER_SOURCE
    extra = stranger(peer.address, "127.0.0.2")
    text = error_text(read_until_closed(extra))  # refused at accept, not cut at the deadline
    extra.close()
    assert text.startswith("too_many_connections:") and "from this address" in text, text
    other = stranger(peer.address, "127.0.0.3")  # another address is still admitted
    read_challenge(other)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    store = make_store()
    try:
        assert await client.fetch([key_of(0), key_of(1)], store, timeout=5) == 2
    finally:
        await client.close()
    for sock in held:
        sock.close()
    wait_until("the held connections' places given back", peer.metrics,
               lambda m: m["unauthenticated"] == 1)
    again = stranger(peer.address, "127.0.0.2")
    read_challenge(again)
    again.close()
    other.close()
    m = wait_until("all closed", peer.metrics, lambda m: m["unauthenticated"] == 0)
    assert m["protocol_errors"]["too_many_connections"] == 1


async def test_unauthenticated_connections_in_all_are_capped_while_authenticated_ones_keep_fetching(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=CHUNK)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)  # before the flood
    # One place each: no source holds more than a newcomer would, so none is closed for it.
    held = [stranger(peer.address, f"127.0.{1 + i // 200}.{2 + i % 200}") for i in range(MAX_UNPROVEN_CONNECTIONS)]
    for sock in held:
        read_challenge(sock)
    assert peer.metrics()["unauthenticated"] == MAX_UNPROVEN_CONNECTIONS
    fresh = stranger(peer.address, "127.0.9.9")
    text = error_text(read_until_closed(fresh))
    fresh.close()
    assert text.startswith("too_many_connections:") and "from all sources" in text, text
    store = make_store()
    try:
        assert await client.fetch([key_of(i) for i in range(4)], store, timeout=5) == 4
    finally:
        await client.close()
    for sock in held:
        sock.close()
    wait_until("the flood's places given back", peer.metrics, lambda m: m["unauthenticated"] == 0)
    late = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    await late.close()


def test_a_newcomer_takes_the_place_of_the_largest_holders_oldest_stranger(
        start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK)
    per = MAX_UNPROVEN_PER_SOURCE
    held = [stranger(peer.address, f"127.0.0.{2 + i // per}") for i in range(MAX_UNPROVEN_CONNECTIONS)]
    for sock in held:
        read_challenge(sock)
    newcomer = stranger(peer.address, "127.0.9.9")  # a pod the siege has not seen
    read_challenge(newcomer)
    assert read_until_closed(held[0]) == b""  # the first source's oldest, closed for it
    m = wait_until("the newcomer counted in the closed one's place", peer.metrics,
                   lambda m: m["protocol_errors"]["too_many_connections"] == 1)
    assert m["unauthenticated"] == MAX_UNPROVEN_CONNECTIONS
    for sock in held + [newcomer]:
        sock.close()
    wait_until("the places given back", peer.metrics, lambda m: m["unauthenticated"] == 0)
    assert peer.metrics()["protocol_errors"]["too_many_connections"] == 1


# ------------------------------------------------------------------ no traceback, summarised logs


BEFORE_THE_PROOF = {
    "bad magic": ("malformed", b"JUNK" + bytes(12)),
    "other wire major": ("malformed", struct.pack("!2sBBIQ", b"KO", 2, 2, 0, 0)),
    "unknown type": ("unknown_type", struct.pack("!2sBBIQ", b"KO", 1, 99, 0, 0)),
    "oversize": ("oversize", proto.encode_header(proto.MessageType.AUTH_RESPONSE, 0, 1 << 40)),
    "truncated proof": ("malformed", proto.encode_header(proto.MessageType.AUTH_RESPONSE, 0, 3)
                        + b"\xff\xff\x00"),
    "chunk": ("unauthenticated", proto.encode_header(proto.MessageType.CHUNK, 0, 1 << 30)),
    "lookup": ("unauthenticated", proto.join(proto.encode_lookup(1, [b"k"]))),
}
AFTER_THE_PROOF = {
    "empty key": ("bad_key", proto.encode_header(proto.MessageType.FETCH, 1, 6) + struct.pack("!IH", 1, 0)),
    "unknown type": ("unknown_type", struct.pack("!2sBBIQ", b"KO", 1, 99, 1, 0)),
    "oversize": ("oversize", proto.encode_header(proto.MessageType.LOOKUP, 1, 1 << 40)),
    "chunk of another size": ("bad_size", proto.encode_header(proto.MessageType.CHUNK, 1, 3 * CHUNK)),
    "truncated key list": ("malformed", proto.encode_header(proto.MessageType.LOOKUP, 1, 7)
                           + struct.pack("!IH", 2, 1) + b"a"),
}


def test_malformed_frames_before_and_after_the_proof_get_a_counted_reason_and_no_traceback(
        start_peer: Callable[..., PeerProcess], tmp_path: Path) -> None:
    log_file = tmp_path / "peer.log"
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK, auth_timeout=1.0, log_file=str(log_file))
    expected: dict[str, int] = {}
    for name, (reason, frame) in BEFORE_THE_PROOF.items():
        sock = stranger(peer.address)
        read_challenge(sock)
        sock.sendall(frame)
        text = error_text(read_until_closed(sock))
        sock.close()
        assert text.startswith(reason + ":"), (name, text)
        expected[reason] = expected.get(reason, 0) + 1
    for name, (reason, frame) in AFTER_THE_PROOF.items():
        sock = authenticated(peer.address)
        sock.sendall(frame)
        text = error_text(read_until_closed(sock))
        sock.close()
        assert text.startswith(reason + ":"), (name, text)
        expected[reason] = expected.get(reason, 0) + 1
    # Fuzz: random bytes (half of them behind a valid magic and version) before and after the
    # proof, from 16 addresses; every connection ends with a counted reason or a clean close.
    rng = random.Random(25)
    fuzz = []
    for i in range(64):
        junk = rng.randbytes(rng.randint(proto.HEADER_BYTES, 600))
        if i % 2:
            junk = proto.MAGIC + bytes([proto.WIRE_MAJOR, rng.randint(0, 16)]) + junk[4:]
        if i % 4 < 2:
            sock = stranger(peer.address, f"127.0.1.{1 + i % 16}")
            read_challenge(sock)
        else:
            sock = authenticated(peer.address)
        sock.sendall(junk)
        fuzz.append(sock)
    for sock in fuzz:
        read_until_closed(sock)
        sock.close()
    m = wait_until("every stranger closed", peer.metrics, lambda m: m["unauthenticated"] == 0)
    counted = m["protocol_errors"]
    assert all(counted[r] >= n for r, n in expected.items()), (counted, expected)
    assert sum(counted.values()) >= sum(expected.values()) + 32  # most fuzz frames are refused
    log = log_file.read_text()
    assert "Traceback" not in log and "exception was never retrieved" not in log, log[-3000:]
    assert max(map(len, log.splitlines()), default=0) < 400  # values clipped


def test_a_hundred_refusals_from_one_address_cost_one_log_line_and_a_hundred_counts(
        start_peer: Callable[..., PeerProcess], tmp_path: Path) -> None:
    log_file = tmp_path / "peer.log"
    peer = start_peer("tcp", chunks=2, chunk_bytes=CHUNK, log_file=str(log_file))
    for _ in range(100):
        sock = stranger(peer.address, "127.0.0.9")
        read_challenge(sock)
        sock.sendall(b"JUNK" + bytes(12))
        assert error_text(read_until_closed(sock)).startswith("malformed:")
        sock.close()
    m = wait_until("a hundred counted", peer.metrics, lambda m: m["protocol_errors"]["malformed"] == 100)
    assert m["unauthenticated"] == 0
    lines = [line for line in log_file.read_text().splitlines() if "127.0.0.9" in line]
    assert len(lines) == 1 and "rejected 127.0.0.9 (data port): malformed" in lines[0], lines
