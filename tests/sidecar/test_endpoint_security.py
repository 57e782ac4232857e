"""Every control endpoint of a running sidecar, asked from another process without credentials.

Only /healthz, /readyz and /metrics answer. The admin endpoints answer 401
before reading the body, so a caller learns nothing (the same bytes whether or
not a key is cached anywhere in the pool); /v1/local answers only inside the
pod; peer calls need a session; a handshake without the pool key is refused
before anything about the pool is said.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from kv_offload_sidecar.peers.handshake import HandshakeInitiator
from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER
from kv_offload_sidecar.peers.pool_keys import admin_token
from kv_offload_tools.chaos.chunks import chunk_keys, store_chunks
from kv_offload_tools.local_pool import LocalPool, example_config

CHUNK = 16 * 1024
# A source address of this host that is neither 127.0.0.1 nor the address dialled:
# what a caller from another pod looks like to the sidecar.
FOREIGN_SOURCE = "127.0.0.2"


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    with LocalPool(2, capacity_bytes=64 * CHUNK) as p:
        with p[0].client() as engine:
            assert store_chunks(engine, chunk_keys("cached", 4), CHUNK) == 4
        p.wait_summaries(timeout=10)
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


def test_handshake_without_the_pool_key_learns_nothing(pool: LocalPool) -> None:
    answers = set()
    for identity in ("a", "b"):
        initiator = HandshakeInitiator(b"not-the-pool-key", pool.local_hello(identity=identity))
        status, _, body = raw(pool[0], "POST", "/v1/handshake", json.dumps(initiator.step1()).encode())
        assert status == 403
        answers.add(body)
    assert len(answers) == 1
    reply = json.loads(answers.pop())
    assert reply["reason"] == "bad_proof" and reply["diff"] == [] and reply["fields"] == []
