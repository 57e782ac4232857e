"""The UCX data plane (ucxx), server and client each in their own process.

UCX reads its environment once per process, so every scenario runs a UCX chunk
server process and a UCX client process (transport_peers.py), once with
``UCX_TLS=sm,self`` (shared memory, CMA) and once with ``UCX_TLS=tcp,self``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from kv_offload_sidecar.data.before_auth import MAX_UNPROVEN_PER_SOURCE
from peer_processes import PEERS_SCRIPT, PeerProcess, run_ucx_client, ucx_env
from waiting import wait_until

TLS = ["sm,self", "tcp,self"]
CHUNK = 256 * 1024


@pytest.mark.parametrize("tls", TLS)
def test_fetch_moves_chunks_byte_identical_and_lookup_returns_the_prefix(
        tls: str, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls=tls, chunks=16, chunk_bytes=CHUNK)
    out = run_ucx_client(peer, "fetch", tls=tls, shm_dir=shm_dir, chunks=16, chunk_bytes=CHUNK)
    assert out["lookup_all"] == 16
    assert out["lookup_gap"] == 3
    assert out["fetched"] == 16 and out["identical"]
    assert out["fetch_missing"] == 0
    # each FETCH is answered with one message of CHUNK / CHUNK_MISSING frames
    assert out["chunk_replies"] == [2, 17]
    assert out["visible_intact"] and out["slots_in_use"] == 16
    assert peer.metrics()["peer_bytes_sent"] == 16 * CHUNK


def test_a_fetch_larger_than_the_servers_send_window_is_answered_in_several_batches(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    from kv_offload_sidecar.data.ucx.server import SERVER_SENDS_IN_FLIGHT

    small, n = 64 * 1024, 150  # the client asks for all 150 in one FETCH (a 16 MiB window)
    peer = start_peer("ucx", tls="sm,self", chunks=n, chunk_bytes=small)
    out = run_ucx_client(peer, "fetch", tls="sm,self", shm_dir=shm_dir, chunks=n, chunk_bytes=small)
    assert out["fetched"] == n and out["identical"]
    messages, frames = out["chunk_replies"]
    assert frames == n + 1
    assert messages >= -(-n // SERVER_SENDS_IN_FLIGHT) + 1
    assert out["visible_intact"] and out["slots_in_use"] == n
    assert peer.metrics()["peer_bytes_sent"] == n * small


@pytest.mark.parametrize("tls", TLS)
def test_two_lanes_split_a_fetch_one_chunk_in_three_to_the_fetcher_copied_lane(
        tls: str, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls=tls, chunks=16, chunk_bytes=CHUNK)
    out = run_ucx_client(peer, "fetch", tls=tls, shm_dir=shm_dir, chunks=16, chunk_bytes=CHUNK,
                         lanes=2)
    assert out["fetched"] == 16 and out["identical"]
    assert out["lookup_all"] == 16 and out["lookup_gap"] == 3 and out["fetch_missing"] == 0
    holder_copied, fetcher_copied = out["lane_chunks"]
    # 16 chunks + the missing key's request: every third goes to the fetcher-copied lane.
    assert (holder_copied, fetcher_copied) == (12, 5)
    # Both connections get the links' heartbeat: a holder closes one silent for 5 s.
    assert out["heartbeats_answered"] == 2
    assert out["visible_intact"] and out["slots_in_use"] == 16
    assert peer.metrics()["peer_bytes_sent"] == 16 * CHUNK


def test_one_lane_sends_every_chunk_over_the_holder_copied_lane(
        start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls="sm,self", chunks=16, chunk_bytes=CHUNK)
    out = run_ucx_client(peer, "fetch", tls="sm,self", shm_dir=shm_dir, chunks=16, chunk_bytes=CHUNK)
    assert out["fetched"] == 16 and out["identical"]
    assert out["lane_chunks"] == [17, 0]
    assert out["heartbeats_answered"] == 1


@pytest.mark.parametrize("corrupt", ["1", "2"])  # chunk 2 travels the fetcher-copied lane
def test_corrupted_chunk_on_either_of_two_lanes_fails_its_checksum_and_is_not_stored(
        corrupt: str, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls="sm,self", chunks=4, chunk_bytes=CHUNK, corrupt=corrupt)
    out = run_ucx_client(peer, "corrupt", tls="sm,self", shm_dir=shm_dir, chunks=4,
                         chunk_bytes=CHUNK, lanes=2, corrupt=corrupt)
    assert out["error"].startswith("integrity:")
    assert not out["corrupt_visible"]
    assert out["visible_intact"] and out["slots_in_use"] == out["visible"] + out["held_after_failure"]


@pytest.mark.parametrize("tls", TLS)
def test_wrong_session_key_gets_no_connection_and_no_chunk(
        tls: str, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls=tls, chunks=4, chunk_bytes=CHUNK)
    out = run_ucx_client(peer, "bad_auth", tls=tls, shm_dir=shm_dir, chunks=4, chunk_bytes=CHUNK)
    assert out["error"] and "deadline" in out["error"]
    assert out["visible"] == 0 and out["slots_in_use"] == 0
    metrics = peer.metrics()
    assert metrics["protocol_errors"]["unauthenticated"] == 1
    assert metrics["peer_bytes_sent"] == 0


@pytest.mark.parametrize("tls", TLS)
def test_server_killed_mid_fetch_fails_within_deadline_leaving_nothing_partial(
        tls: str, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    big = 1 << 20
    peer = start_peer("ucx", tls=tls, chunks=48, chunk_bytes=big)
    out = run_ucx_client(peer, "kill", tls=tls, shm_dir=shm_dir, chunks=48, chunk_bytes=big)
    assert out["killed"] and out["error"], out  # the fetching process survived and raised
    assert 1 <= out["visible"] < 48
    assert out["visible_intact"]
    # Every reservation was released, but those a receive was still posted into: the dead
    # holder's writes cannot be told over (ucx.client: kept, then quarantined).
    assert out["slots_in_use"] == out["visible"] + out["held_after_failure"]


# A chunk below OFF_LOOP_BYTES is verified on the loop, a larger one on a checksum thread.
@pytest.mark.parametrize("chunk_bytes", [CHUNK, 2 << 20], ids=["on-loop", "checksum-thread"])
@pytest.mark.parametrize("tls", TLS)
def test_corrupted_chunk_fails_its_checksum_and_is_not_stored(
        tls: str, chunk_bytes: int, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls=tls, chunks=4, chunk_bytes=chunk_bytes, corrupt="1")
    out = run_ucx_client(peer, "corrupt", tls=tls, shm_dir=shm_dir, chunks=4, chunk_bytes=chunk_bytes,
                         corrupt="1")
    assert out["error"].startswith("integrity:")
    assert not out["corrupt_visible"]
    # Receives still posted when the connection failed keep their slots until they complete.
    assert out["visible_intact"] and out["slots_in_use"] == out["visible"] + out["held_after_failure"]


@pytest.mark.parametrize("tls", TLS)
def test_bad_frames_get_clear_errors_and_the_server_keeps_serving(
        tls: str, start_peer: Callable[..., PeerProcess], shm_dir: str, tmp_path: Path) -> None:
    log_file = tmp_path / "peer.log"
    peer = start_peer("ucx", tls=tls, chunks=16, chunk_bytes=CHUNK, log_file=str(log_file))
    out = run_ucx_client(peer, "garbage", tls=tls, shm_dir=shm_dir, chunks=16, chunk_bytes=CHUNK)
    assert out["oversize_reply"].startswith("ERROR oversize:")
    assert out["unknown_type_reply"].startswith("ERROR unknown_type:")
    assert out["truncated_reply"].startswith("ERROR malformed:")
    assert out["fetched_after"] == 16 and out["identical_after"]
    errors = peer.metrics()["protocol_errors"]
    # junk on the attach tag + the truncated FETCH; a wrong attach MAC; one each of the rest
    assert errors["malformed"] == 2 and errors["unauthenticated"] == 1
    assert errors["oversize"] == 1 and errors["unknown_type"] == 1
    assert peer.alive()
    log = log_file.read_text()
    assert "Traceback" not in log and "rejected ucx attach: malformed" in log, log[-3000:]


@pytest.mark.parametrize("tls", TLS)
def test_before_the_proof_a_big_frame_is_refused_and_one_session_holds_few_places_for_a_short_time(
        tls: str, start_peer: Callable[..., PeerProcess], shm_dir: str) -> None:
    peer = start_peer("ucx", tls=tls, chunks=4, chunk_bytes=CHUNK, auth_timeout=1.0)
    client = subprocess.Popen(
        [sys.executable, PEERS_SCRIPT, "ucx-client", "--tls", tls, "--scenario", "before_auth",
         "--address", peer.address, "--chunks", "4", "--chunk-bytes", str(CHUNK), "--shm-dir", shm_dir],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ucx_env(tls))
    try:
        assert client.stdout is not None and client.stdin is not None
        line = client.stdout.readline()
        assert line, "the UCX client ended before holding its attaches"
        assert json.loads(line) == {"held": MAX_UNPROVEN_PER_SOURCE}
        m = wait_until("the attach past the session's places refused", peer.metrics,
                       lambda m: m["protocol_errors"]["too_many_connections"] == 1)
        assert m["unauthenticated"] == MAX_UNPROVEN_PER_SOURCE
        client.stdin.write("go\n")
        client.stdin.flush()
        out = json.loads(client.stdout.readlines()[-1])
        assert client.wait(30) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(5)
    assert out["big_proof_reply"].startswith("ERROR oversize:"), out
    m = wait_until("the held attaches cut at the deadline", peer.metrics, lambda m: m["unauthenticated"] == 0)
    assert m["protocol_errors"]["timeout"] == MAX_UNPROVEN_PER_SOURCE
    assert m["protocol_errors"]["oversize"] == 1
    after = run_ucx_client(peer, "fetch", tls=tls, shm_dir=shm_dir, chunks=4, chunk_bytes=CHUNK)
    assert after["fetched"] == 4 and after["identical"]


def test_ucx_settings_are_refused_once_ucxx_is_imported() -> None:
    code = (
        "from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env\n"
        "configure_ucx_env('tcp,self')\n"
        "import ucxx\n"
        "configure_ucx_env('tcp,self')\n"  # same settings: fine
        "try:\n"
        "    configure_ucx_env('sm,self')\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=ucx_env("tcp,self"))
    assert done.returncode == 0, done.stderr
    assert "refused: ucxx is already imported" in done.stdout and "UCX_TLS" in done.stdout


def test_a_lane_count_other_than_one_or_two_is_refused_naming_the_choices() -> None:
    from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env

    with pytest.raises(ValueError, match=r"lanes=3 is not supported; use 1 .* or 2"):
        configure_ucx_env("sm,self", lanes=3)
