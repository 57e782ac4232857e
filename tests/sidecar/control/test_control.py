"""The control app in process (aiohttp_client): handshake, directory messages, strict bodies, views."""

from __future__ import annotations

import json
import os

import pytest
from aiohttp import web
from kv_offload_sidecar.control.app import SIDECAR_KEY, create_app
from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.peers.handshake import WIRE_VERSION, HandshakeInitiator, HelloMessage
from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER
from kv_offload_sidecar.peers.directory.location_wire import PublishBatch, key_digest, location_auth
from kv_offload_sidecar.peers.pool_keys import admin_token
from kv_offload_sidecar.peers.wire_window import WIRE_OLDEST
from kv_offload_sidecar.sidecar import Sidecar
from kv_offload_testing.local_pool import example_config
from kv_offload_testing.scrape import parse_metrics
from sidecar_support import identified, peer_hello

# The key of the make_settings fixture (tests/sidecar/conftest.py).
POOL_KEY = b"test-pool-key"



@pytest.fixture
async def sidecar_client(aiohttp_client, make_settings):
    sidecar = identified(Sidecar(make_settings()))
    async with running(sidecar, control_ports=False):
        client = await aiohttp_client(create_app(sidecar, 0))
        client.sidecar = sidecar
        yield client
        await client.close()


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
    response = await sidecar_client.get("/metrics")
    assert response.headers["Content-Type"].startswith("text/plain")
    text = await response.text()
    assert f'fingerprint="{example_config().fingerprint}"' in text
    assert "kv_offload_store_capacity_bytes" in text


async def location_post(client, session, op: str, body: dict, *, auth: str | None = None,
                        sid: str | None = None):
    raw = json.dumps(body).encode()
    headers = {SESSION_HEADER: sid if sid is not None else session.session_id.hex(),
               AUTH_HEADER: auth if auth is not None else location_auth(session.session_key, op, raw),
               "Content-Type": "application/json"}
    return await client.post(f"/v1/{op}", data=raw, headers=headers)


def publish(seq: int, digests: list[int], *, reset: bool = False, epoch: str = "ab") -> dict:
    return PublishBatch(epoch, seq, reset, False, tuple((d, d & 0xFFFFFFFF) for d in digests), ()).to_dict()


async def test_accepted_handshake_opens_the_directory_to_the_peer(sidecar_client):
    resp, _, session = await handshake(sidecar_client)
    assert resp.status == 200
    assert await metric(sidecar_client, "kv_offload_handshakes_total", result="accepted") == 1
    d = key_digest(b"chunk-a")
    resp = await location_post(sidecar_client, session, "publish", publish(1, [d], reset=True))
    assert resp.status == 200 and await resp.json() == {"resync": False}
    # The holder is the session's peer (its hello), whatever the body says.
    assert sidecar_client.sidecar.location.directory.holders_of(d) == ["peer-x"]
    resp = await location_post(sidecar_client, session, "locate", {"digests": publish(1, [d])["removes"]})
    assert resp.status == 400  # an empty digest list names no key
    from kv_offload_sidecar.peers.directory.location_wire import LocateQuery
    resp = await location_post(sidecar_client, session, "locate", LocateQuery((d,)).to_dict())
    assert resp.status == 200 and await resp.json() == {"holders": []}  # the asker is not named to itself
    assert sidecar_client.sidecar.authorize(session.session_id) == session.session_key


async def test_a_publish_that_skips_a_message_asks_for_the_full_share(sidecar_client):
    _, _, session = await handshake(sidecar_client)
    d1, d2 = key_digest(b"one"), key_digest(b"two")
    assert await (await location_post(sidecar_client, session, "publish", publish(1, [d1], reset=True))).json() \
        == {"resync": False}
    resp = await location_post(sidecar_client, session, "publish", publish(3, [d2]))  # seq 2 was lost
    assert await resp.json() == {"resync": True}
    assert sidecar_client.sidecar.location.directory.holders_of(d2) == []
    resp = await location_post(sidecar_client, session, "publish", publish(4, [d2], reset=True))
    assert await resp.json() == {"resync": False}
    directory = sidecar_client.sidecar.location.directory
    assert directory.holders_of(d1) == [] and directory.holders_of(d2) == ["peer-x"]


async def test_directory_messages_without_a_valid_session_or_hmac_are_401(sidecar_client):
    _, _, session = await handshake(sidecar_client)
    body = publish(1, [key_digest(b"x")], reset=True)
    for op in ("publish", "locate"):
        for kw in ({"sid": ""}, {"sid": "zz"}, {"sid": "00" * 16}, {"auth": "00" * 32},
                   {"auth": location_auth(session.session_key, "other", json.dumps(body).encode())}):
            resp = await location_post(sidecar_client, session, op, body, **kw)
            assert resp.status == 401
            assert "handshake first" in (await resp.json())["error"]
    assert await metric(sidecar_client, "kv_offload_protocol_errors_total", reason="unauthenticated") == 10
    assert len(sidecar_client.sidecar.location.directory) == 0


@pytest.mark.parametrize("body, phrase", [
    ({"epoch": "ab", "seq": 0, "reset": True, "adds": "", "removes": ""}, "seq"),
    ({"epoch": "XY", "seq": 1, "reset": True, "adds": "", "removes": ""}, "epoch"),
    ({"epoch": "ab", "seq": 1, "reset": True, "adds": "AAA=", "removes": ""}, "multiple of 12"),
    ([1, 2], "JSON object"),
])
async def test_malformed_publish_is_400_naming_the_problem(sidecar_client, body, phrase):
    _, _, session = await handshake(sidecar_client)
    resp = await location_post(sidecar_client, session, "publish", body)
    assert resp.status == 400 and phrase in (await resp.json())["error"]


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


async def test_wrong_pool_key_is_rejected_as_another_pool_at_step_1(sidecar_client):
    initiator = HandshakeInitiator(b"not-the-key", peer_hello())
    resp = await sidecar_client.post("/v1/handshake", json=initiator.step1())
    body = await resp.json()
    assert resp.status == 403 and body["reason"] == "other_pool"
    assert body["fields"] == [] and body["diff"] == [] and "hello" not in body
    assert await metric(sidecar_client, "kv_offload_handshakes_total", reason="other_pool") == 1


async def test_a_stranger_of_another_wire_version_gets_the_bytes_of_any_stranger(sidecar_client):
    answers = set()
    for version in (WIRE_VERSION, "1.0", "3.0"):
        step1 = {**HandshakeInitiator(b"not-the-key", peer_hello()).step1(), "wire_version": version}
        resp = await sidecar_client.post("/v1/handshake", json=step1)
        assert resp.status == 403
        answers.add(await resp.read())
    assert len(answers) == 1
    answer = answers.pop()
    assert b"other_pool" in answer and WIRE_VERSION.encode() not in answer


async def test_a_key_holder_of_another_wire_version_is_told_after_its_proof(sidecar_client):
    initiator = HandshakeInitiator(POOL_KEY, HelloMessage(**{**peer_hello().to_dict(), "wire_version": "3.0"}))
    resp = await sidecar_client.post("/v1/handshake", json={**initiator.step1(), "wire_version": "3.0"})
    assert resp.status == 200
    resp = await sidecar_client.post("/v1/handshake", json=initiator.step2(await resp.json()))
    body = await resp.json()
    assert resp.status == 403 and body["reason"] == "wire_version_mismatch"
    assert body["diff"] == [f"wire_version: speaks {WIRE_OLDEST}..{WIRE_VERSION} != 3.0..3.0 (no version in common)"]
    assert await metric(sidecar_client, "kv_offload_handshakes_total", reason="wire_version_mismatch") == 1


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
    ("/v1/route", b'{"keys": ["xyz"]}', 400, "keys[0]"),
    ("/v1/route", b'[1]', 400, "object"),
])
async def test_bad_bodies_get_clear_json_errors_and_service_continues(sidecar_client, path, data, status, phrase):
    resp = await sidecar_client.post(path, data=data, headers={"Content-Type": "application/json", **ADMIN})
    assert resp.status == status
    body = await resp.json()
    assert phrase in body["error"]
    assert (await sidecar_client.get("/healthz")).status == 200


async def test_oversized_body_is_413_with_json_error(sidecar_client):
    limit = sidecar_client.sidecar.settings.network.max_body_bytes
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


async def test_a_route_hint_names_this_pod_with_its_local_prefix(sidecar_client):
    sidecar = sidecar_client.server.app[SIDECAR_KEY]
    keys = [os.urandom(20) for _ in range(3)]
    for r in sidecar.reserve(keys[:2]):
        r.view[:] = bytes(len(r.view))
        r.commit()
    resp = await sidecar_client.post("/v1/route", json={"keys": [k.hex() for k in keys]}, headers=ADMIN)
    assert resp.status == 200
    assert await resp.json() == {"asked": 3, "pods": [
        {"pod": sidecar.settings.network.identity, "address": sidecar.control_address, "chunks": 2}]}
    resp = await sidecar_client.post("/v1/route", json={"keys": [keys[2].hex()]}, headers=ADMIN)
    assert (await resp.json())["pods"] == []


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


async def test_status_shows_the_cpu_budget_and_where_it_came_from(sidecar_client, monkeypatch):
    from kv_offload_sidecar.cpu_budget import CPU_REQUEST_ENV, cpu_budget, read_cpu_budget

    monkeypatch.setenv(CPU_REQUEST_ENV, "1000")  # a one-core request: the budget where no limit is set
    cpu_budget.cache_clear()
    try:
        status = await (await sidecar_client.get("/v1/status", headers=ADMIN)).json()
        assert status["cpu_budget"] == read_cpu_budget().view()
        assert status["cpu_budget"]["cpus"] >= 1 and status["cpu_budget"]["from"]
    finally:
        cpu_budget.cache_clear()


async def test_inbound_peer_is_dialled_back(sidecar_client):
    await handshake(sidecar_client, hello=peer_hello(control_address="127.0.0.1:9"))
    assert "127.0.0.1:9" in sidecar_client.sidecar.discovery.current()


async def test_stop_unlinks_store_and_socket(make_settings):
    sidecar = identified(Sidecar(make_settings()))
    async with running(sidecar):
        store_path = sidecar.store.path
        socket_path = sidecar.local_socket_path(0)
        assert os.path.exists(store_path) and os.path.exists(socket_path) and sidecar.ready
    assert not os.path.exists(store_path) and not os.path.exists(socket_path)
    assert not sidecar.ready


def test_create_app_keeps_state_under_typed_keys(make_settings):
    from kv_offload_sidecar.control.app import DP_INDEX_KEY

    sidecar = identified(Sidecar(make_settings()))
    app = create_app(sidecar, 3)
    assert isinstance(app, web.Application)
    assert app[SIDECAR_KEY] is sidecar and app[DP_INDEX_KEY] == 3


@pytest.mark.parametrize("method, path", [("POST", "/v1/lookup"), ("POST", "/v1/route"),
                                          ("GET", "/v1/status"), ("GET", "/v1/peers")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {admin_token(POOL_KEY)}",
                                  f"Bearer {admin_token(b'another-pool-key')}"])
async def test_admin_endpoints_need_the_admin_token(sidecar_client, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    resp = await sidecar_client.request(method, path, json={"keys": ["00"]}, headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "admin-token" in (await resp.json())["error"]


async def test_a_configured_admin_token_opens_the_admin_endpoints(aiohttp_client, make_settings):
    sidecar = identified(Sidecar(make_settings(admin_token=b"ops-secret")))
    async with running(sidecar, control_ports=False):
        client = await aiohttp_client(create_app(sidecar, 0))
        assert (await client.get("/v1/status", headers={"Authorization": "Bearer ops-secret"})).status == 200
        assert (await client.get("/v1/status", headers=ADMIN)).status == 200
        assert (await client.get("/v1/status", headers={"Authorization": "Bearer ops"})).status == 401
        await client.close()


async def test_directory_replies_ask_for_a_rekey_when_the_session_key_is_not_current(sidecar_client):
    from kv_offload_sidecar.peers.pool_keys import PoolKeys
    from kv_offload_sidecar.peers.sessions import REKEY_HEADER

    _, _, session = await handshake(sidecar_client, key=PoolKeys(b"next-pool-key", POOL_KEY))
    resp = await location_post(sidecar_client, session, "publish", publish(1, [], reset=True))
    assert resp.status == 200 and REKEY_HEADER not in resp.headers
    sidecar_client.sidecar.keys._set(b"next-pool-key", POOL_KEY, b"")  # the Secret rotated here first
    resp = await location_post(sidecar_client, session, "publish", publish(2, []))
    assert resp.status == 200 and resp.headers[REKEY_HEADER] == "1"
