"""Every control endpoint of a running sidecar, asked from another process without credentials.

Only /healthz, /readyz and /metrics answer. The admin endpoints answer 401
before reading the body, so a caller learns nothing (the same bytes whether or
not a key is cached anywhere in the pool); /v1/local answers only inside the
pod; peer calls need a session; a handshake without the pool key is refused
before anything about the pool, its wire version included, is said. Strangers who
hold connections open, send slowly, flood or send what does not parse are cut,
refused or answered 4xx within seconds, with one short log line per source and
reason, no traceback, and the memory they took returned.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import time
from collections.abc import Iterator

import pytest
from kv_offload_sidecar import __version__
from kv_offload_sidecar.control.limits import (
    HANDSHAKE_BURST,
    MAX_UNPROVEN_CONNECTIONS,
    MAX_UNPROVEN_PER_SOURCE,
    UNPROVEN_REQUEST_SECONDS,
)
from kv_offload_sidecar.control.request_limits import BODY_SECONDS
from kv_offload_sidecar.peers.handshake import WIRE_VERSION, HandshakeInitiator
from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER
from kv_offload_sidecar.peers.pool_keys import admin_token
from kv_offload_tools.chaos.chunks import chunk_keys, store_chunks
from kv_offload_testing.local_pool import LocalPool, example_config
from waiting import wait_for

CHUNK = 16 * 1024
# A source address of this host that is neither 127.0.0.1 nor the address dialled:
# what a caller from another pod looks like to the sidecar.
FOREIGN_SOURCE = "127.0.0.2"
# Socket timeout of a stranger's connection (the sidecar's own limits are a few seconds).
PATIENCE = 20.0


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    with LocalPool(2, capacity_bytes=64 * CHUNK) as p:
        with p[0].client() as engine:
            assert store_chunks(engine, chunk_keys("cached", 4), CHUNK) == 4
        p.wait_directory_current(timeout=10)
        yield p


def raw(sc, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
        source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request from this process (optionally from another source address)."""
    conn = http.client.HTTPConnection(sc.host, sc.port, timeout=5,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_only_health_readiness_and_metrics_answer_without_credentials(pool: LocalPool) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert raw(pool[1], "GET", path, source=FOREIGN_SOURCE)[0] == 200


def test_lookup_without_the_admin_token_is_401_and_says_nothing_about_the_pool(pool: LocalPool) -> None:
    cached = [k.hex() for k in chunk_keys("cached", 4)]
    absent = [k.hex() for k in chunk_keys("never-stored", 4)]
    answers = set()
    for keys in (cached, absent):
        for headers in ({}, {"Authorization": "Bearer guess"}, {"Authorization": f"Bearer {absent[0]}"}):
            status, got_headers, body = raw(pool[1], "POST", "/v1/lookup", json.dumps({"keys": keys}).encode(),
                                            headers)
            assert status == 401 and got_headers["WWW-Authenticate"].startswith("Bearer")
            answers.add(body)
    assert len(answers) == 1  # the same bytes whether or not the keys are cached in the pool
    # with the token the same question is answered: sidecar 1 finds them at its peer
    status, body = pool[1].post("/v1/lookup", {"keys": cached})
    assert status == 200 and body == {"local": 0, "peer": 4}
    token = admin_token(pool.pool_key)  # the token a holder of the pool key derives
    status, _, body = raw(pool[1], "POST", "/v1/lookup", json.dumps({"keys": cached}).encode(),
                          {"Authorization": f"Bearer {token}"})
    assert status == 200 and json.loads(body)["peer"] == 4


@pytest.mark.parametrize("path", ["/v1/status", "/v1/peers"])
def test_status_and_peers_need_the_admin_token(pool: LocalPool, path: str) -> None:
    status, _, body = raw(pool[0], "GET", path)
    assert status == 401
    text = body.decode()
    for secret in (pool[0].identity, pool[1].identity, example_config().fingerprint, "data_address"):
        assert secret not in text
    assert pool[0].get(path)[0] == 200


def test_local_channel_info_answers_only_inside_the_pod(pool: LocalPool) -> None:
    status, _, body = raw(pool[0], "GET", "/v1/local", source=FOREIGN_SOURCE)
    assert status == 403 and b"only inside the pod" in body
    assert b"socket" not in body and b"slot" not in body
    status, _, body = raw(pool[0], "GET", "/v1/local")  # the engine's own call (127.0.0.1)
    assert status == 200 and json.loads(body)["socket"].endswith(".sock")


@pytest.mark.parametrize("path", ["/v1/publish", "/v1/locate"])
def test_directory_messages_need_a_session(pool: LocalPool, path: str) -> None:
    body = json.dumps({"digests": "AAAAAAAAAAA=", "epoch": "ab", "seq": 1, "reset": True,
                       "adds": "", "removes": ""}).encode()
    before = pool[0].status()["location"]["entries"]
    for headers in ({}, {SESSION_HEADER: "00" * 16, AUTH_HEADER: "00" * 32}):
        status, _, answer = raw(pool[0], "POST", path, body, headers=headers)
        assert status == 401 and b"holders" not in answer and b"resync" not in answer
    assert pool[0].status()["location"]["entries"] == before  # nothing was applied


def test_handshake_without_the_pool_key_learns_nothing_whatever_its_wire_version(pool: LocalPool) -> None:
    answers = set()
    for identity, version in (("a", WIRE_VERSION), ("b", WIRE_VERSION), ("c", "1.0"), ("d", "3.0")):
        initiator = HandshakeInitiator(b"not-the-pool-key", pool.local_hello(identity=identity))
        step1 = {**initiator.step1(), "wire_version": version}
        status, headers, body = raw(pool[0], "POST", "/v1/handshake", json.dumps(step1).encode())
        assert status == 403 and headers["Server"] == "kv-offload"
        answers.add(body)
    assert len(answers) == 1
    reply = json.loads(answers.pop())
    assert reply["reason"] == "other_pool" and reply["diff"] == [] and reply["fields"] == []


def test_public_metrics_name_no_model_or_dtype_only_the_release_and_wire_version(pool: LocalPool) -> None:
    status, _, body = raw(pool[1], "GET", "/metrics", source=FOREIGN_SOURCE)
    info = [line for line in body.decode().splitlines() if line.startswith("kv_offload_config_info{")]
    assert status == 200 and len(info) == 1 and example_config().fingerprint in info[0]
    assert "Qwen" not in info[0] and "dtype" not in info[0] and "wire_version" not in info[0]
    # the release and its wire version are public, as its image tag is (a rollout shows them)
    build = [line for line in body.decode().splitlines() if line.startswith("kv_offload_build_info{")]
    assert build == [f'kv_offload_build_info{{version="{__version__}",wire="{WIRE_VERSION}"}} 1.0']


def connect(sc, source: str) -> socket.socket:
    return socket.create_connection((sc.host, sc.port), timeout=PATIENCE, source_address=(source, 0))


def read_all(sock: socket.socket) -> bytes:
    """Everything until the sidecar closes (a reset after its answer counts as closed)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def unproven(sc) -> float:
    """Unproven connections open at ``sc`` held to the limits on strangers. The scrape comes from
    127.0.0.1, where the pool's members dial from: a source that proved itself, not counted."""
    return sc.metric("kv_offload_control_connections", state="unproven")


def test_slow_and_silent_strangers_are_cut_within_seconds_and_their_memory_returned(pool: LocalPool) -> None:
    sc = pool[1]
    wait_for("no unproven connection", lambda: unproven(sc) == 0)
    rss_before = sc.rss_bytes()
    partial_body = (b"POST /v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Length: 32000\r\n\r\n"
                    + b'{"step": "hello", "pad": "' + b"x" * 30_000)
    kinds = [b"", b"POST /v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Le", partial_body]
    socks = []
    held = MAX_UNPROVEN_CONNECTIONS  # every place, a few per source (none closed for another)
    for i in range(held):
        sock = connect(sc, f"127.0.0.{10 + i % 24}")
        sock.sendall(kinds[i % 3])
        socks.append(sock)
    started = time.monotonic()
    wait_for(f"{held} unproven connections", lambda: unproven(sc) == held)
    rss_peak = sc.rss_bytes()
    for sock in socks:
        read_all(sock)  # returns once the sidecar closed it
        sock.close()
    assert time.monotonic() - started < UNPROVEN_REQUEST_SECONDS + BODY_SECONDS
    wait_for("the connections to be forgotten", lambda: unproven(sc) == 0)
    assert rss_peak - rss_before < 32 << 20
    assert sc.rss_bytes() - rss_before < 8 << 20
    assert sc.metric("kv_offload_protocol_errors_total", reason="timeout") >= held
    assert pool[0].peers()[0]["state"] == "connected"


def test_one_source_holds_at_most_its_share_of_unproven_connections(pool: LocalPool) -> None:
    sc = pool[0]
    wait_for("no unproven connection", lambda: unproven(sc) == 0)
    before = sc.metric("kv_offload_protocol_errors_total", reason="too_many_connections")
    held = [connect(sc, "127.0.0.5") for _ in range(MAX_UNPROVEN_PER_SOURCE)]
    wait_for("the source's share", lambda: unproven(sc) == MAX_UNPROVEN_PER_SOURCE)
    extra = connect(sc, "127.0.0.5")
    answer = read_all(extra)
    extra.close()
    assert answer.startswith(b"HTTP/1.1 503") and b"too many unauthenticated connections" in answer
    assert sc.metric("kv_offload_protocol_errors_total", reason="too_many_connections") == before + 1
    assert raw(sc, "GET", "/healthz", source="127.0.0.6")[0] == 200  # other sources are served
    for sock in held:
        sock.close()
    wait_for("the held connections to go", lambda: unproven(sc) == 0)
    assert raw(sc, "GET", "/healthz", source="127.0.0.5")[0] == 200


UNPARSEABLE = [
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 70_000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
    b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 9000 + b"\r\n\r\n",
]
BAD_HANDSHAKE_BODIES = [
    b"[" * 10_000 + b"]" * 10_000,
    b'{"step": "hello", "nonce": ' + b"9" * 5000 + b"}",
    json.dumps({"step": "x" * 20_000}).encode(),
    json.dumps({"step": "x" * 200_000}).encode(),
]


def test_hostile_requests_get_4xx_short_logs_and_no_traceback(pool: LocalPool) -> None:
    sc = pool[0]
    log_before = os.path.getsize(sc.log_path)
    rounds = 2
    assert rounds * (len(BAD_HANDSHAKE_BODIES) + 10) <= HANDSHAKE_BURST  # none is rate limited
    for _ in range(rounds):
        for data in UNPARSEABLE:
            sock = connect(sc, "127.0.0.7")
            sock.sendall(data)
            assert read_all(sock).startswith(b"HTTP/1.0 400")
            sock.close()
        for body in BAD_HANDSHAKE_BODIES:
            status, _, _ = raw(sc, "POST", "/v1/handshake", body, source="127.0.0.7")
            assert status in (400, 413)
        for _ in range(10):
            step1 = HandshakeInitiator(b"not-the-pool-key", pool.local_hello()).step1()
            assert raw(sc, "POST", "/v1/handshake", json.dumps(step1).encode(), source="127.0.0.7")[0] == 403
    with open(sc.log_path, "rb") as fh:
        fh.seek(log_before)
        written = fh.read()
    assert b"Traceback" not in written and b"ERROR" not in written
    assert len(written) < 4096, written.decode(errors="replace")  # one line per reason, not per request
