"""The NIXL data plane: one-sided READs from the holder's slot into the fetcher's, each process
its own NIXL agents (server: transport_peers.py, client: nixl_client.py).

NIXL must import here: ./dev installs it (``pip install --no-deps nixl-cu12``), so a missing
install fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.data.nixl.runtime import WIREUP_SECONDS
from kv_offload_sidecar.data.tcp.sockets import split_host_port
from peer_processes import HERE, PeerProcess
from transport_peers import SESSION_ID, SESSION_KEY
from waiting import wait_for

CHUNK = 256 * 1024
CLIENT_SCRIPT = f"{HERE}/nixl_client.py"


def run_client(peer: PeerProcess, scenario: str, *, shm_dir: str, chunks: int, chunk_bytes: int = CHUNK,
               corrupt: str = "", timeout: float = 90) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, CLIENT_SCRIPT, scenario, "--address", peer.address, "--server-pid", str(peer.pid),
         "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes), "--shm-dir", shm_dir,
         "--corrupt", corrupt],
        capture_output=True, text=True, timeout=timeout, cwd=HERE,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"nixl client {scenario} exited {done.returncode}: {done.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_nixl_imports_without_torch() -> None:
    code = "import sys, kv_offload_sidecar.data.nixl.runtime as r; r.import_nixl(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"  # the image has no torch; nixl must not need it


def test_fetch_reads_chunks_byte_identical_and_releases_every_lease(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("nixl", chunks=16, chunk_bytes=CHUNK)
    assert peer.address.startswith("nixl://")
    before = time.monotonic()
    out = run_client(peer, "fetch", shm_dir=shm_dir, chunks=16)
    assert out["lookup_all"] == 16 and out["lookup_gap"] == 3
    assert out["fetched"] == 16 and out["identical"]
    assert out["fetch_missing"] == 0
    assert out["visible_intact"] and out["slots_in_use"] == 16
    state = peer.ask("nixl")
    assert state["exported_views"] == 1  # one view for the one authenticated connection
    assert state["leased"] == 0 and state["pinned"] == 0  # every chunk released after its read
    # Answering the FETCH opened the serving lane's wire-up window (CLOCK_MONOTONIC is one
    # clock for both processes), so the fetcher lane's first READ did not wait for its
    # once-a-second progress.
    assert state["serving_hot_until"] >= before + WIREUP_SECONDS
    wait_for("the closed connection's view revoked", lambda: peer.ask("nixl")["live_views"] == 0)
    assert peer.metrics()["peer_bytes_sent"] == 16 * CHUNK


def test_multi_mib_chunks_are_read_in_pieces_and_verified(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    big = 3 * (1 << 20) + 4096  # not a whole number of pieces
    peer = start_peer("nixl", chunks=6, chunk_bytes=big)
    out = run_client(peer, "fetch", shm_dir=shm_dir, chunks=6, chunk_bytes=big)
    assert out["fetched"] == 6 and out["identical"] and out["visible_intact"]


def test_a_wrong_session_key_gets_no_view_no_metadata_and_no_chunk(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("nixl", chunks=4, chunk_bytes=CHUNK)
    out = run_client(peer, "bad_auth", shm_dir=shm_dir, chunks=4)
    assert out["error"] and "unauthenticated" in out["error"]
    assert out["visible"] == 0 and out["slots_in_use"] == 0
    assert peer.ask("nixl")["exported_views"] == 0
    assert peer.metrics()["protocol_errors"]["unauthenticated"] == 1


def _raw_frames(address: str, frames: list[list]) -> list[tuple[proto.MessageType, bytes]]:
    """Open a plain TCP connection to a nixl server, send ``frames``, read until it closes."""
    host, port = split_host_port(address.split("://", 1)[1])
    got: list[tuple[proto.MessageType, bytes]] = []
    with socket.create_connection((host, port), timeout=5) as sock:
        reader = sock.makefile("rb")

        def read() -> tuple[proto.MessageType, bytes] | None:
            head = reader.read(proto.HEADER_BYTES)
            if len(head) < proto.HEADER_BYTES:
                return None
            header = proto.decode_header(head)
            return header.type, reader.read(header.length)

        first = read()
        assert first is not None and first[0] is proto.MessageType.AUTH_CHALLENGE
        nonce = first[1]
        for frame in frames:
            sock.sendall(proto.join([f(nonce) if callable(f) else f for f in frame]))
        while (item := read()) is not None:
            got.append(item)
    return got


@pytest.mark.parametrize("name, frames", [
    ("wrong proof", [proto.encode_auth_response(SESSION_ID, b"\0" * 32)]),
    ("unknown session", [[lambda n: proto.join(proto.encode_auth_response(b"nobody", auth_proof(SESSION_KEY, n)))]]),
    ("fetch before auth", [proto.encode_fetch(1, [b"k" * 36])]),
    ("release before auth", [[proto.encode_header(proto.MessageType.RELEASE, 0, 4), b"\0\0\0\0"]]),
])
def test_an_unauthenticated_client_gets_no_registration_and_no_metadata(
        name: str, frames: list, start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("nixl", chunks=4, chunk_bytes=CHUNK)
    got = _raw_frames(peer.address, frames)
    assert [t for t, _ in got] == [proto.MessageType.ERROR], got
    assert got[0][1].startswith(b"unauthenticated:")
    assert all(t is not proto.MessageType.NIXL_METADATA for t, _ in got)
    assert peer.ask("nixl") == {"live_views": 0, "exported_views": 0, "dark_views": 0, "leased": 0,
                                "pinned": 0, "serving_hot_until": 0.0}
    assert peer.metrics()["protocol_errors"]["unauthenticated"] == 1


def test_the_right_proof_gets_metadata_sealed_for_this_session_and_connection(
        start_peer: Callable[..., PeerProcess]) -> None:
    from kv_offload_sidecar.data.nixl.frames import decode_metadata

    peer = start_peer("nixl", chunks=4, chunk_bytes=CHUNK)
    nonces: list[bytes] = []

    def answer(nonce: bytes) -> bytes:
        nonces.append(nonce)
        return proto.join(proto.encode_auth_response(SESSION_ID, auth_proof(SESSION_KEY, nonce)))

    got = _raw_frames(peer.address, [[answer], proto.encode_close()])
    types = [t for t, _ in got]
    assert types[:2] == [proto.MessageType.AUTH_OK, proto.MessageType.NIXL_METADATA]
    sealed = got[1][1]
    assert SESSION_ID not in sealed and b"UCX" not in sealed  # nothing readable without the key
    view = decode_metadata(sealed, SESSION_KEY, nonces[0])
    assert view.num_slots >= 4 and view.slot_bytes == CHUNK and view.metadata
    with pytest.raises(proto.ProtocolError, match="unauthenticated"):
        decode_metadata(sealed, b"another session key", nonces[0])
    with pytest.raises(proto.ProtocolError, match="unauthenticated"):
        decode_metadata(sealed, SESSION_KEY, b"\0" * 16)  # another connection's nonce


def test_a_view_is_revoked_when_its_session_ends_so_kept_metadata_reads_nothing_of_the_store(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("nixl", chunks=8, chunk_bytes=CHUNK)
    proc = subprocess.Popen(
        [sys.executable, CLIENT_SCRIPT, "revoke", "--address", peer.address, "--chunks", "8",
         "--chunk-bytes", str(CHUNK), "--shm-dir", shm_dir],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready = proc.stdout.readline()
        assert ready and json.loads(ready)["ready"], proc.stderr.read() if proc.stderr else ""
        assert peer.ask("nixl")["live_views"] == 1
        peer.ask("end_sessions")
        wait_for("the ended session's view revoked", lambda: peer.ask("nixl")["live_views"] == 0)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out_text, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    out = json.loads(out_text.strip().splitlines()[-1])
    assert out["fetched"] == 2
    assert out["raw_read_before"] == "read"  # the same read works while the session lives
    # Kept metadata reads nothing of the store: it fails, or reads the dark range's zeros.
    assert out["raw_read_after"] == "zeros" or out["raw_read_after"].startswith("failed"), out
    assert str(out["fetch_after"]).startswith("error")
    assert out["visible_intact"] and out["slots_in_use"] == out["visible"] == 2


def test_a_revoked_views_range_stays_dark_until_the_next_view_takes_it(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("nixl", chunks=4, chunk_bytes=CHUNK)
    for n in (1, 2):
        out = run_client(peer, "fetch", shm_dir=shm_dir, chunks=4)
        assert out["fetched"] == 4 and out["identical"]
        wait_for("the closed connection's view revoked", lambda: peer.ask("nixl")["live_views"] == 0)
        state = peer.ask("nixl")
        # The second connection's view took the first one's dark range: the address space
        # held stays at the most views live at once.
        assert (state["exported_views"], state["dark_views"]) == (n, 1)


def _read_own(address: int, length: int) -> bytes | int:
    """``process_vm_readv`` of this process's own ``address`` (what a cma READ does): the bytes
    read, or minus the errno."""
    import ctypes

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(length)
    local, remote = IoVec(ctypes.addressof(buf), length), IoVec(address, length)
    got = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buf.raw[:got] if got >= 0 else -ctypes.get_errno()


def test_a_dark_range_reads_zeros_by_address_never_the_store_and_is_lent_again_readable(
        tmp_path: Path) -> None:
    import mmap

    from kv_offload_sidecar.data.nixl import exports

    path = tmp_path / "store"
    path.write_bytes(b"K" * (2 * mmap.PAGESIZE))
    mapping, key = exports._lend_range(str(path), 2 * mmap.PAGESIZE)
    base = exports._address_of(mapping)
    assert _read_own(base, 16) == b"K" * 16
    exports._darken(key, mapping)
    try:
        assert exports.dark_views() == 1
        # By address alone, as cma reads: zeros, never the store's bytes, and no fault (a send
        # from the range still under way when the view was revoked must not kill the holder).
        assert _read_own(base, 16) == bytes(16)
        again, key2 = exports._lend_range(str(path), 2 * mmap.PAGESIZE)
        assert (exports._address_of(again), key2, exports.dark_views()) == (base, key, 0)
        assert again[:4] == b"KKKK" and _read_own(base, 16) == b"K" * 16
        exports._darken(key2, again)
    finally:
        assert exports.forget_dark_views(str(path)) == 1
    assert exports.dark_views() == 0


def test_a_corrupted_chunk_fails_its_checksum_and_is_not_stored(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("nixl", chunks=4, chunk_bytes=CHUNK, corrupt="1")
    out = run_client(peer, "corrupt", shm_dir=shm_dir, chunks=4, corrupt="1")
    assert out["error"].startswith("integrity:")
    assert not out["corrupt_visible"]
    assert out["visible_intact"] and out["slots_in_use"] == out["visible"]


def test_holder_killed_mid_fetch_fails_within_the_deadline_leaving_nothing_partial(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    big = 1 << 20
    peer = start_peer("nixl", chunks=48, chunk_bytes=big)
    out = run_client(peer, "kill", shm_dir=shm_dir, chunks=48, chunk_bytes=big)
    assert out["killed"] and out["error"], out  # the fetching process survived and raised
    assert 1 <= out["visible"] < 48
    assert out["visible_intact"]
    assert out["slots_in_use"] == out["visible"]  # every reservation was released


def test_a_peer_that_never_releases_pins_at_most_the_lease_limit(
        start_peer: Callable[..., PeerProcess]) -> None:
    from kv_offload_sidecar.data.nixl.server import MAX_LEASES_PER_CONNECTION
    from transport_peers import key_of

    n = MAX_LEASES_PER_CONNECTION + 20
    peer = start_peer("nixl", chunks=n, chunk_bytes=4096)

    def answer(nonce: bytes) -> bytes:
        return proto.join(proto.encode_auth_response(SESSION_ID, auth_proof(SESSION_KEY, nonce)))

    got = _raw_frames(peer.address, [[answer], proto.encode_fetch(1, [key_of(i) for i in range(n)]),
                                     proto.encode_close()])
    types = [t for t, _ in got[2:]]
    assert types == ([proto.MessageType.CHUNK_AT] * MAX_LEASES_PER_CONNECTION
                     + [proto.MessageType.CHUNK_MISSING] * 20)
    wait_for("every lease ended with the connection", lambda: peer.ask("nixl")["pinned"] == 0)
