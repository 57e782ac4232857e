"""The control app in process (aiohttp_client): handshake, summaries, strict bodies, views."""

from __future__ import annotations

import json
import os

import pytest
from aiohttp import web
from kv_offload_sidecar.control.app import create_app
from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.peers.handshake import HandshakeInitiator, make_hello
from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER, summary_auth
from kv_offload_sidecar.peers.pool_keys import admin_token
from kv_offload_sidecar.sidecar import Sidecar
from kv_offload_tools.local_pool import example_config
from kv_offload_tools.scrape import parse_metrics

# The key of the make_settings fixture (tests/sidecar/conftest.py).
POOL_KEY = b"test-pool-key"



@pytest.fixture
async def sidecar_client(aiohttp_client, make_settings):
    sidecar = Sidecar(make_settings())
    async with running(sidecar, control_ports=False):
        client = await aiohttp_client(create_app(sidecar, 0))
        client.sidecar = sidecar
        yield client
        await client.close()


def peer_hello(config=None, **changes):
    cfg = config or example_config()
    fields = dict(fingerprint=cfg.fingerprint, hash_seed="0", kv_bytes_per_chunk=cfg.kv_bytes_per_chunk,
                  identity="peer-x", control_address="127.0.0.1:1", data_address="tcp://127.0.0.1:2",
                  transport="tcp", run_config=cfg.run_config())
    fields.update(changes)
    return make_hello(**fields)


async def metric(client, name: str, **labels: str) -> float:
    text = await (await client.get("/metrics")).text()
    want = set(labels.items())
    return sum(v for (n, lab), v in parse_metrics(text).items() if n == name and want <= set(lab))


ADMIN = {"Authorization": f"Bearer {admin_token(POOL_KEY)}"}


async def handshake(client, key: bytes = POOL_KEY, hello=None):
    """Both steps; (step-2 response, step-2 body, session or None when step 2 was refused)."""
    initiator = HandshakeInitiator(key, hello or peer_hello())
    resp = await client.post("/v1/handshake", json=initiator.step1())
    assert resp.status == 200, await resp.text()
    step2 = initiator.step2(await resp.json())
    resp = await client.post("/v1/handshake", json=step2)
    session = initiator.finish(await resp.json())[1] if resp.status == 200 else None
    return resp, step2, session


async def test_health_readiness_and_metrics_are_served(sidecar_client):
    assert (await sidecar_client.get("/healthz")).status == 200
    assert (await sidecar_client.get("/readyz")).status == 200
    text = await (await sidecar_client.get("/metrics")).text()
    assert f'fingerprint="{example_config().fingerprint}"' in text
    assert "kv_offload_store_capacity_bytes" in text


async def test_accepted_handshake_opens_summary_pulls(sidecar_client):
    resp, _, session = await handshake(sidecar_client)
    assert resp.status == 200
    assert await metric(sidecar_client, "kv_offload_handshakes_total", result="accepted") == 1
    headers = {SESSION_HEADER: session.session_id.hex(), AUTH_HEADER: summary_auth(session.session_key, "", 0)}
    resp = await sidecar_client.get("/v1/summary", params={"since": "0", "epoch": ""}, headers=headers)
    assert resp.status == 200
    body = await resp.json()
    assert body["reset"] is True and body["added"] == ""
    assert sidecar_client.sidecar.authorize(session.session_id) == session.session_key


async def test_summary_without_valid_session_is_401(sidecar_client):
    _, _, session = await handshake(sidecar_client)
    for headers in ({}, {SESSION_HEADER: session.session_id.hex(), AUTH_HEADER: "00" * 32},
                    {SESSION_HEADER: "zz", AUTH_HEADER: "x"}):
        resp = await sidecar_client.get("/v1/summary", params={"since": "0", "epoch": ""}, headers=headers)
        assert resp.status == 401
        assert "handshake first" in (await resp.json())["error"]
    assert await metric(sidecar_client, "kv_offload_protocol_errors_total", reason="unauthenticated") == 3


@pytest.mark.parametrize("changes, reason, field", [
    ({"config": example_config(tokens_per_hash=32)}, "fingerprint_mismatch", "tokens_per_hash"),
    ({"fingerprint": ""}, "fingerprint_mismatch", "fingerprint"),
    ({"hash_seed": "7"}, "hash_seed_mismatch", "hash_seed"),
    ({"kv_bytes_per_chunk": 999}, "chunk_size_mismatch", "kv_bytes_per_chunk"),
])
async def test_mismatching_key_holder_is_rejected_with_reason_and_fields(sidecar_client, changes, reason,
                                                                      field):
    resp, _, session = await handshake(sidecar_client, hello=peer_hello(**changes))
    assert resp.status == 403 and session is None
    body = await resp.json()
    assert body["reason"] == reason
    assert field in body["fields"]
    assert "hello" not in body and "proof" not in body  # nothing that lets it continue
    assert POOL_KEY.decode() not in json.dumps(body)
    assert await metric(sidecar_client, "kv_offload_handshakes_total", result="rejected", reason=reason) == 1


async def test_wrong_pool_key_is_rejected_as_bad_proof_at_step_1(sidecar_client):
    initiator = HandshakeInitiator(b"not-the-key", peer_hello())
    resp = await sidecar_client.post("/v1/handshake", json=initiator.step1())
    body = await resp.json()
    assert resp.status == 403 and body["reason"] == "bad_proof"
    assert body["fields"] == [] and body["diff"] == [] and "hello" not in body
    assert await metric(sidecar_client, "kv_offload_handshakes_total", reason="bad_proof") == 1


async def test_replayed_handshake_is_rejected(sidecar_client):
    resp, step2, _ = await handshake(sidecar_client)
    resp = await sidecar_client.post("/v1/handshake", json=step2)
    assert resp.status == 403 and (await resp.json())["reason"] == "replay"
    assert await metric(sidecar_client, "kv_offload_handshakes_total", reason="replay") == 1


@pytest.mark.parametrize("path, data, status, phrase", [
    ("/v1/handshake", b"{not json", 400, "not valid JSON"),
    ("/v1/handshake", b"\xff\xfe", 400, "not valid JSON"),
    ("/v1/handshake", b"[]", 400, "'step'"),
    ("/v1/handshake", b'{"step": "dance"}', 400, "'step'"),
    ("/v1/handshake", b'{"step": "hello", "hello": {"identity": 1}}', 400, "wire_version"),
    ("/v1/handshake", b'{"step": "proof", "nonce_client": 5}', 400, "nonce_client"),
    ("/v1/lookup", b'{"keys": "abc"}', 400, "list of hex"),
    ("/v1/lookup", b'{"keys": ["xyz"]}', 400, "keys[0]"),
    ("/v1/lookup", b'{"keys": [""]}', 400, "keys[0]"),
    ("/v1/lookup", json.dumps({"keys": ["00"] * 5000}).encode(), 400, "at most"),
    ("/v1/lookup", b'{"keys": ["00"], "timeout": -1}', 400, "timeout"),
    ("/v1/lookup", b'"keys"', 400, "object"),
])
async def test_bad_bodies_get_clear_json_errors_and_service_continues(sidecar_client, path, data, status, phrase):
    resp = await sidecar_client.post(path, data=data, headers={"Content-Type": "application/json", **ADMIN})
    assert resp.status == status
    body = await resp.json()
    assert phrase in body["error"]
    assert (await sidecar_client.get("/healthz")).status == 200


async def test_oversized_body_is_413_with_json_error(sidecar_client):
    limit = sidecar_client.sidecar.settings.max_body_bytes
    resp = await sidecar_client.post("/v1/handshake", data=b"x" * (limit + 1))
    assert resp.status == 413
    assert "exceeds" in (await resp.json())["error"]
    assert await metric(sidecar_client, "kv_offload_protocol_errors_total", reason="oversize") >= 1
    assert (await sidecar_client.get("/readyz")).status == 200


async def test_unknown_path_and_method_get_json_errors(sidecar_client):
    resp = await sidecar_client.get("/v1/nothing")
    assert resp.status == 404 and "error" in await resp.json()
    resp = await sidecar_client.get("/v1/handshake")
    assert resp.status == 405 and "error" in await resp.json()


async def test_lookup_counts_each_chunk_key(sidecar_client):
    resp = await sidecar_client.post("/v1/lookup", json={"keys": [os.urandom(36).hex() for _ in range(3)]},
                                     headers=ADMIN)
    assert await resp.json() == {"local": 0, "peer": 0}
    assert await metric(sidecar_client, "kv_offload_chunk_lookups_total", result="miss") == 3
    assert await metric(sidecar_client, "kv_offload_lookup_messages_total") == 0


async def test_local_view_names_socket_and_store_geometry(sidecar_client):
    body = await (await sidecar_client.get("/v1/local")).json()
    store = sidecar_client.sidecar.store
    assert body["store"] == {"path": store.path, "slot_bytes": store.slot_bytes,
                             "slot_stride": store.slot_stride, "num_slots": store.num_slots}
    assert os.path.exists(body["socket"]) and os.path.exists(store.path)


async def test_status_and_peers_views(sidecar_client):
    status = await (await sidecar_client.get("/v1/status", headers=ADMIN)).json()
    assert status["identity"] == "test-sidecar"
    assert status["data_address"].startswith("tcp://127.0.0.1:")
    assert status["store"]["capacity_bytes"] <= 1 << 20
    assert (await (await sidecar_client.get("/v1/peers", headers=ADMIN)).json()) == {"peers": []}


async def test_inbound_peer_is_dialled_back(sidecar_client):
    await handshake(sidecar_client, hello=peer_hello(control_address="127.0.0.1:9"))
    assert "127.0.0.1:9" in sidecar_client.sidecar.discovery.current()


async def test_stop_unlinks_store_and_socket(make_settings):
    sidecar = Sidecar(make_settings())
    async with running(sidecar):
        store_path = sidecar.store.path
        socket_path = sidecar.local_socket_path(0)
        assert os.path.exists(store_path) and os.path.exists(socket_path) and sidecar.ready
    assert not os.path.exists(store_path) and not os.path.exists(socket_path)
    assert not sidecar.ready


def test_create_app_keeps_state_under_typed_keys(make_settings):
    from kv_offload_sidecar.control.app import DP_INDEX_KEY, SIDECAR_KEY

    sidecar = Sidecar(make_settings())
    app = create_app(sidecar, 3)
    assert isinstance(app, web.Application)
    assert app[SIDECAR_KEY] is sidecar and app[DP_INDEX_KEY] == 3


@pytest.mark.parametrize("method, path", [("POST", "/v1/lookup"), ("GET", "/v1/status"),
                                          ("GET", "/v1/peers")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {admin_token(POOL_KEY)}",
                                  f"Bearer {admin_token(b'another-pool-key')}"])
async def test_admin_endpoints_need_the_admin_token(sidecar_client, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    resp = await sidecar_client.request(method, path, json={"keys": ["00"]}, headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "admin-token" in (await resp.json())["error"]


async def test_a_configured_admin_token_opens_the_admin_endpoints(aiohttp_client, make_settings):
    sidecar = Sidecar(make_settings(admin_token=b"ops-secret"))
    async with running(sidecar, control_ports=False):
        client = await aiohttp_client(create_app(sidecar, 0))
        assert (await client.get("/v1/status", headers={"Authorization": "Bearer ops-secret"})).status == 200
        assert (await client.get("/v1/status", headers=ADMIN)).status == 200
        assert (await client.get("/v1/status", headers={"Authorization": "Bearer ops"})).status == 401
        await client.close()


async def test_summary_replies_ask_for_a_rekey_when_the_session_key_is_not_current(sidecar_client):
    from kv_offload_sidecar.peers.pool_keys import PoolKeys
    from kv_offload_sidecar.peers.sessions import REKEY_HEADER

    _, _, session = await handshake(sidecar_client, key=PoolKeys(b"next-pool-key", POOL_KEY))
    headers = {SESSION_HEADER: session.session_id.hex(), AUTH_HEADER: summary_auth(session.session_key, "", 0)}
    resp = await sidecar_client.get("/v1/summary", params={"since": "0", "epoch": ""}, headers=headers)
    assert resp.status == 200 and REKEY_HEADER not in resp.headers
    sidecar_client.sidecar.keys._set(b"next-pool-key", POOL_KEY, b"")  # the Secret rotated here first
    resp = await sidecar_client.get("/v1/summary", params={"since": "0", "epoch": ""}, headers=headers)
    assert resp.status == 200 and resp.headers[REKEY_HEADER] == "1"
