"""Authentication under attack: no pool key, another pool's key, replays, skipped handshakes.

Every attacker must get no chunk byte and store nothing; a sidecar without a
readable pool key must not start.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.peers.handshake import (
    HandshakeInitiator,
    Session,
    derive_session,
)
from kv_offload_sidecar.peers.pool_keys import key_id
from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_tools.chaos.probes import RawDataConnection, probe_handshake
from kv_offload_testing.local_pool import LocalPool, SidecarOverride, sidecar_command
from waiting import wait_for

CHUNK = 16 * 1024


def _rejections(pool: LocalPool, identity: str, reason: str) -> float:
    return pool[identity].metric("kv_offload_handshakes_total", reason=reason, result="rejected")


def _no_chunk_frames(frames: list) -> bool:
    return all(h is None or h.type not in (proto.MessageType.CHUNK, proto.MessageType.AUTH_OK,
                                           proto.MessageType.LOOKUP_REPLY) for h, _ in frames)


def _victim(pool: LocalPool) -> tuple[list[bytes], str]:
    victim = pool.add(identity="victim", peers=[])
    keys = chunk_keys("victim-secret", 4)
    with victim.client() as engine:
        assert store_chunks(engine, keys, CHUNK) == 4
    return keys, victim.status()["data_address"]


def _assert_data_plane_refuses(data_address: str, keys: list[bytes], session=None) -> None:
    """FETCH on a data connection (authenticated with ``session`` if given) yields no chunk."""
    with RawDataConnection(data_address) as conn:
        conn.read_challenge()
        if session is not None:
            with pytest.raises(ConnectionError, match="authentication refused"):
                conn.authenticate(session)
        else:
            conn.send(proto.encode_fetch(1, keys))
            frames = conn.read_until_closed()
            assert _no_chunk_frames(frames), frames
            assert frames and frames[-1][0] is not None
            assert frames[-1][0].type is proto.MessageType.ERROR
            assert b"unauthenticated" in frames[-1][1]


def test_peer_without_the_pool_key_is_rejected_and_gets_no_chunk(chaos_pool: LocalPool) -> None:
    keys, data_address = _victim(chaos_pool)
    victim = chaos_pool["victim"]
    before = victim.status()
    hello = chaos_pool.local_hello(identity="intruder")
    initiator = HandshakeInitiator(b"not-the-pool-key", hello)
    status, reply = victim.post("/v1/handshake", initiator.step1())
    # refused at step 1: no nonce, no hello, no field diff, nothing about the pool
    assert status == 403 and reply["reason"] == "other_pool"
    assert reply["diff"] == [] and reply["fields"] == [] and "hello" not in reply and "nonce" not in reply
    assert _rejections(chaos_pool, "victim", "other_pool") == 1
    # copying a member's key id gets a nonce, but the proof fails, again without a diff
    step1 = {**initiator.step1(), "key_ids": [key_id(chaos_pool.pool_key).hex()]}
    status, reply1 = victim.post("/v1/handshake", step1)
    assert status == 200 and set(reply1) == {"wire_version", "wire_min", "wire_max", "nonce", "key_id"}
    forged = {"step": "proof", "nonce_client": step1["nonce"], "nonce_server": reply1["nonce"],
              "hello": hello.to_dict(), "proof": "ab" * 32}
    status, reply = victim.post("/v1/handshake", forged)
    assert status == 403 and reply["reason"] == "bad_proof" and reply["diff"] == []
    assert _rejections(chaos_pool, "victim", "bad_proof") == 1
    # A session derived from the wrong key is unknown to the data plane.
    sid, skey = derive_session(b"not-the-pool-key", bytes.fromhex(step1["nonce"]),
                               bytes.fromhex(reply1["nonce"]))
    _assert_data_plane_refuses(data_address, keys, Session(sid, skey, hello))
    after = victim.status()
    assert after["inbound_sessions"] == before["inbound_sessions"]
    assert after["store"]["chunks"] == before["store"]["chunks"] == 4


def test_sidecar_of_another_pool_gets_no_chunk_and_stores_none(chaos_pool: LocalPool) -> None:
    keys, _ = _victim(chaos_pool)
    intruder = chaos_pool.add(SidecarOverride(pool_key=b"another-pool-key-fedcba9876543210"),
                              identity="intruder", peers=["victim"])
    own = chunk_keys("intruder-own", 3)
    with intruder.client() as e_in, chaos_pool["victim"].client() as e_vi:
        assert store_chunks(e_in, own, CHUNK) == 3
        wait_for("the victim rejecting the intruder (another pool)",
                 lambda: _rejections(chaos_pool, "victim", "other_pool") >= 1)
        time.sleep(0.5)  # several publish intervals: nothing may leak meanwhile
        # Each side asks for the other's chunks: misses, nothing fetched, nothing stored.
        assert e_in.lookup(keys).hits == 0
        assert load_and_verify(e_in, keys, CHUNK) == (0, 0)
        assert e_vi.lookup(own).hits == 0
        assert load_and_verify(e_vi, own, CHUNK) == (0, 0)
    assert intruder.status()["store"]["chunks"] == 3
    assert chaos_pool["victim"].status()["store"]["chunks"] == 4
    assert chaos_pool["victim"].metric("kv_offload_peer_bytes_total", direction="sent") == 0
    assert chaos_pool["intruder"].metric("kv_offload_peer_bytes_total", direction="received") == 0


def test_replayed_handshake_is_rejected_and_gets_no_session(chaos_pool: LocalPool) -> None:
    keys, data_address = _victim(chaos_pool)
    victim = chaos_pool["victim"]
    # A legitimate member handshakes; the attacker records both bodies and the data-plane answer.
    captured = probe_handshake(victim, chaos_pool.pool_key, chaos_pool.local_hello(identity="member"))
    with RawDataConnection(data_address) as conn:
        conn.authenticate(captured.session)
        recorded_auth = proto.encode_auth_response(
            captured.session.session_id, auth_proof(captured.session.session_key, conn.nonce))
    sessions = victim.status()["inbound_sessions"]
    step1, step2 = captured.sent
    status, reply = victim.post("/v1/handshake", step2)
    assert status == 403 and reply["reason"] == "replay"
    status, reply = victim.post("/v1/handshake", step1)
    assert status == 403 and reply["reason"] == "replay"
    assert _rejections(chaos_pool, "victim", "replay") == 2
    assert victim.status()["inbound_sessions"] == sessions
    # Replaying the recorded data-plane answer fails: every connection gets a fresh nonce.
    with RawDataConnection(data_address) as conn:
        conn.read_challenge()
        conn.send(b"".join(recorded_auth))
        conn.send(proto.encode_fetch(1, keys))
        frames = conn.read_until_closed()
    assert _no_chunk_frames(frames), frames
    assert frames[-1][0] is not None and frames[-1][0].type is proto.MessageType.ERROR
    assert victim.status()["store"]["chunks"] == 4


def test_skipping_the_handshake_gets_an_error_and_no_chunk(chaos_pool: LocalPool) -> None:
    keys, data_address = _victim(chaos_pool)
    before = chaos_pool["victim"].metric("kv_offload_protocol_errors_total", reason="unauthenticated")
    _assert_data_plane_refuses(data_address, keys)  # FETCH right after the nonce
    with RawDataConnection(data_address) as conn:  # LOOKUP straight away, never reading the nonce
        conn.send(proto.encode_lookup(7, keys))
        frames = conn.read_until_closed()
    assert _no_chunk_frames(frames), frames
    # The directory is also closed to strangers.
    for path in ("/v1/publish", "/v1/locate"):
        status, body = chaos_pool["victim"].post(path, {"digests": "AAAAAAAAAAA="})
        assert status == 401 and "handshake" in body["error"]
    after = chaos_pool["victim"].metric("kv_offload_protocol_errors_total", reason="unauthenticated")
    assert after >= before + 3
    assert chaos_pool["victim"].status()["store"]["chunks"] == 4


def _run_sidecar(pool: LocalPool, key_path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*sidecar_command(), "sidecar", "--config", pool.config_path, "--pool-key-file", key_path,
         "--host", "127.0.0.1", "--base-port", "1", "--data-port", "0", "--shm-dir", pool.workdir],
        capture_output=True, text=True, timeout=60)


def _store_files(directory: str) -> list[str]:
    """Store files and local sockets in a sidecar's --shm-dir."""
    return [f for f in os.listdir(directory) if f.endswith((".slots", ".sock"))]


@pytest.mark.parametrize("case", ["missing", "unreadable", "empty"])
def test_sidecar_without_a_readable_pool_key_refuses_to_start(chaos_pool: LocalPool, case: str) -> None:
    path = os.path.join(chaos_pool.workdir, f"key-{case}")
    if case == "unreadable":
        os.mkdir(path)  # a directory cannot be read as a file, even by root
    elif case == "empty":
        open(path, "wb").close()
    result = _run_sidecar(chaos_pool, path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert path in lines[0] and "pool key file" in lines[0]
    assert {"missing": "does not exist", "unreadable": "unreadable", "empty": "empty"}[case] in lines[0]
    assert _store_files(chaos_pool.workdir) == []
