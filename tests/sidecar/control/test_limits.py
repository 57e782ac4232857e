"""What a stranger may cost on the control port (control/limits.py and request_limits.py),
asked over real sockets.

The sidecar runs in process behind ``ControlPorts``; clients are raw TCP connections from
127.0.0.x source addresses, so each test controls every byte and every source. Time limits
are shortened with monkeypatch; tests wait for the guard's own counts, not for a time.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from kv_offload_sidecar.control import limits, request_limits
from kv_offload_sidecar.control.app import ControlPorts
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.peers.handshake import MAX_HANDSHAKE_BODY_BYTES, HandshakeInitiator
from kv_offload_sidecar.peers.pool_keys import admin_token
from kv_offload_sidecar.sidecar import Sidecar
from kv_offload_testing.local_pool import example_config
from sidecar_support import identified, peer_hello
from waiting import wait_for_async

# The key of the make_settings fixture (tests/sidecar/conftest.py).
POOL_KEY = b"test-pool-key"
# Bound on any one read of a test (far above every shortened limit).
PATIENCE = 10.0


@pytest.fixture
async def ports(make_settings):
    sidecar = identified(Sidecar(make_settings()))
    async with running(sidecar, control_ports=False):
        control = ControlPorts(sidecar)
        await control.start()
        control.sidecar = sidecar
        control.port = sidecar.settings.network.control_port(0)
        try:
            yield control
        finally:
            await control.stop()


@pytest.fixture
def short_limits(monkeypatch):
    monkeypatch.setattr(limits, "UNPROVEN_REQUEST_SECONDS", 0.3)
    monkeypatch.setattr(request_limits, "BODY_SECONDS", 0.3)


async def connect(ports, source: str = "127.0.0.2"):
    return await asyncio.open_connection("127.0.0.1", ports.port, local_addr=(source, 0))


async def exchange(ports, data: bytes, source: str = "127.0.0.2") -> bytes:
    """Send ``data`` and read until the sidecar closes the connection."""
    reader, writer = await connect(ports, source)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), PATIENCE)
    finally:
        writer.close()


def errors(ports, reason: str) -> float:
    return ports.sidecar.registry.get_sample_value("kv_offload_protocol_errors_total", {"reason": reason})


def post(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> bytes:
    return answer.split(b"\r\n\r\n", 1)[1]


def header(answer: bytes, name: str) -> str | None:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.decode().partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


async def test_a_request_whose_headers_never_end_is_cut(ports, short_limits):
    answer = await exchange(ports, b"POST /v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert answer == b""
    assert errors(ports, "timeout") == 1
    await wait_for_async("the connection to be forgotten", lambda: ports.guard.open == 0)


async def test_a_silent_connection_is_cut(ports, short_limits):
    assert await exchange(ports, b"") == b""
    assert errors(ports, "timeout") == 1


async def test_an_idle_unproven_keep_alive_connection_is_cut_after_its_answer(ports, short_limits):
    answer = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(answer) == 200 and b'"ok"' in answer
    assert errors(ports, "timeout") == 1


async def test_a_body_that_stops_short_is_408_and_closed(ports, short_limits):
    step1 = json.dumps(HandshakeInitiator(POOL_KEY, peer_hello()).step1()).encode()
    answer = await exchange(ports, post("/v1/handshake", step1)[:-10])
    assert status_of(answer) == 408 and b"not complete within" in answer
    assert errors(ports, "timeout") == 1


async def hold_five(ports):
    """Limits of 3 per source and 5 in all, all held by strangers (3 from 127.0.0.2, then 2 from
    127.0.0.3), each a request begun and never ended; their (reader, writer), oldest first."""
    ports.guard.limit.per_source, ports.guard.limit.total = 3, 5
    held = []
    for source in ["127.0.0.2"] * 3 + ["127.0.0.3"] * 2:
        reader, writer = await connect(ports, source)
        writer.write(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
        held.append((reader, writer))
        await wait_for_async(f"{len(held)} unproven connections",
                             lambda n=len(held): ports.guard.unproven == n)
    return held


async def test_one_source_and_all_sources_hold_only_so_many_unproven_connections(ports):
    held = [writer for _, writer in await hold_five(ports)]
    assert ports.sidecar.registry.get_sample_value("kv_offload_control_connections",
                                                   {"state": "unproven"}) == 5
    same_source = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "127.0.0.2")
    # 127.0.0.3 would hold as many as the largest holder with one more: no room is made for it.
    next_largest = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "127.0.0.3")
    for answer in (same_source, next_largest):
        assert status_of(answer) == 503 and header(answer, "Retry-After") == "1"
        assert b"too many unauthenticated connections" in answer
    assert errors(ports, "too_many_connections") == 2
    for writer in held:
        writer.close()
    await wait_for_async("the held connections to go",
                         lambda: ports.guard.unproven == 0 and ports.guard.open == 0)
    answer = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(answer) == 200


async def test_a_newcomer_takes_the_place_of_the_largest_holders_oldest_stranger(ports):
    held = await hold_five(ports)
    answer = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                            "127.0.0.4")
    assert status_of(answer) == 200
    oldest = held[0][0]
    assert await asyncio.wait_for(oldest.read(), PATIENCE) == b""  # 127.0.0.2's first, aborted
    assert errors(ports, "too_many_connections") == 1
    await wait_for_async("the newcomer gone, the evicted one forgotten", lambda: ports.guard.unproven == 4)
    for _, writer in held:
        writer.close()
    await wait_for_async("the held connections to go", lambda: ports.guard.open == 0)


async def test_memory_goes_back_once_strangers_left(ports):
    ports.guard.limit.trim_after = 3
    held = [(await connect(ports, f"127.0.0.{i}"))[1] for i in (2, 3, 4)]
    await wait_for_async("3 strangers", lambda: ports.guard.unproven == 3)
    assert ports.guard.trims == 0
    for writer in held:
        writer.close()
    await wait_for_async("the memory to be handed back", lambda: ports.guard.trims == 1)


async def prove_admin(ports, source: str = "127.0.0.2"):
    """A keep-alive connection from ``source`` that proved the admin token."""
    reader, writer = await connect(ports, source)
    writer.write(f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin_token(POOL_KEY)}\r\n"
                 f"\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    return writer


async def test_a_proven_connection_leaves_the_unproven_limits(ports):
    ports.guard.limit.per_source = 1
    writer = await prove_admin(ports)
    await wait_for_async("the admin's connection to be proven", lambda: ports.guard.unproven == 0)
    assert ports.guard.open == 1  # still open, no longer counted
    assert ports.sidecar.registry.get_sample_value("kv_offload_control_connections",
                                                   {"state": "proven"}) == 1
    answer = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(answer) == 200
    writer.close()


async def test_a_flood_of_strangers_does_not_refuse_a_source_that_proved_itself(ports):
    ports.guard.limit.total = 3
    (await prove_admin(ports, "127.0.0.2")).close()
    await wait_for_async("the member's connection to close", lambda: ports.guard.open == 0)
    held = []
    for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
        held.append((await connect(ports, source))[1])
    await wait_for_async("the strangers to fill the unproven connections", lambda: ports.guard.unproven == 3)
    stranger = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "127.0.0.6")
    member = await exchange(ports, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                            "127.0.0.2")
    assert status_of(stranger) == 503 and status_of(member) == 200
    for writer in held:
        writer.close()


async def test_untrusted_handshakes_over_the_burst_get_429_before_their_body_is_read(ports, monkeypatch):
    monkeypatch.setattr(limits, "HANDSHAKE_BURST", 3)
    step1 = json.dumps(HandshakeInitiator(b"not-the-pool-key", peer_hello()).step1()).encode()
    answers = [await exchange(ports, post("/v1/handshake", step1, "Connection: close\r\n"))
               for _ in range(4)]
    assert [status_of(a) for a in answers] == [403, 403, 403, 429]
    assert header(answers[-1], "Retry-After") == str(limits.RETRY_AFTER_SECONDS)
    assert b"too many handshakes" in answers[-1]
    assert errors(ports, "rate_limited") == 1
    assert ports.sidecar.registry.get_sample_value("kv_offload_handshakes_total",
                                                   {"result": "rejected", "reason": "other_pool"}) == 3
    other = await exchange(ports, post("/v1/handshake", step1, "Connection: close\r\n"), "127.0.0.3")
    assert status_of(other) == 403  # another source has its own bucket


async def test_a_source_that_proved_itself_is_not_rate_limited(ports, monkeypatch):
    monkeypatch.setattr(limits, "HANDSHAKE_BURST", 1)
    (await prove_admin(ports, "127.0.0.2")).close()
    for _ in range(3):
        session = await member_handshake(ports, "127.0.0.2")
        assert session is not None
    assert errors(ports, "rate_limited") == 0


async def member_handshake(ports, source: str):
    """Both handshake steps as a pool member from ``source``, each on a new connection; its
    session (None when a step was refused)."""
    initiator = HandshakeInitiator(POOL_KEY, peer_hello())
    answer = await exchange(ports, post("/v1/handshake", json.dumps(initiator.step1()).encode(),
                                        "Connection: close\r\n"), source)
    if status_of(answer) != 200:
        return None
    step2 = initiator.step2(json.loads(body_of(answer)))
    answer = await exchange(ports, post("/v1/handshake", json.dumps(step2).encode(),
                                        "Connection: close\r\n"), source)
    return initiator.finish(json.loads(body_of(answer)))[1] if status_of(answer) == 200 else None


async def open_data_connection(ports, source: str, session):
    """A data connection from ``source``: its first frame's type, after AUTH_RESPONSE with
    ``session`` when the server sent a challenge."""
    host, port = ports.sidecar.data_address.split("://", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    try:
        header = proto.decode_header(await asyncio.wait_for(reader.readexactly(proto.HEADER_BYTES), PATIENCE))
        payload = await reader.readexactly(header.length)
        if header.type is not proto.MessageType.AUTH_CHALLENGE or session is None:
            return header.type
        writer.write(proto.join(proto.encode_auth_response(session.session_id,
                                                           auth_proof(session.session_key, payload))))
        header = proto.decode_header(await asyncio.wait_for(reader.readexactly(proto.HEADER_BYTES), PATIENCE))
        return header.type
    finally:
        writer.close()


async def test_a_new_member_joins_and_connects_while_strangers_fill_every_budget(ports):
    for limit in (ports.guard.limit, ports.sidecar.data_server._limit):
        limit.per_source, limit.total = 2, 4
    control = [(await connect(ports, source))[1] for source in ["127.0.0.3"] * 2 + ["127.0.0.4"] * 2]
    await wait_for_async("strangers to hold every unproven control place", lambda: ports.guard.unproven == 4)
    host, port = ports.sidecar.data_address.split("://", 1)[1].rsplit(":", 1)
    data = [(await asyncio.open_connection(host, int(port), local_addr=(source, 0)))[1]
            for source in ["127.0.1.3"] * 2 + ["127.0.1.4"] * 2]
    server = ports.sidecar.data_server
    await wait_for_async("strangers to hold every unauthenticated data place", lambda: server.unauthenticated == 4)
    # One of their sources more is refused; another takes a stranger's place (the one mechanism).
    assert await open_data_connection(ports, "127.0.1.4", None) is proto.MessageType.ERROR
    assert await open_data_connection(ports, "127.0.0.8", None) is proto.MessageType.AUTH_CHALLENGE

    session = await member_handshake(ports, "127.0.0.9")  # a pod never seen before
    assert session is not None
    assert await open_data_connection(ports, "127.0.0.9", session) is proto.MessageType.AUTH_OK
    for writer in control + data:
        writer.close()


UNPARSEABLE = {
    "request line of 70 kB": b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header of 70 kB": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 70_000 + b"\r\n\r\n",
    "300 headers": (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300))
                    + b"\r\n"),
    "bearer token of 9 kB": (b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 9000
                             + b"\r\n\r\n"),
    "not HTTP": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 100 + b"\r\n\r\n",
}


@pytest.mark.parametrize("data", UNPARSEABLE.values(), ids=UNPARSEABLE.keys())
async def test_an_unparseable_request_is_a_counted_400_without_a_traceback(ports, data, caplog):
    caplog.set_level(logging.DEBUG)
    before = errors(ports, "oversize") + errors(ports, "malformed")
    answer = await exchange(ports, data)
    assert status_of(answer) == 400 and header(answer, "Server") == "kv-offload"
    assert errors(ports, "oversize") + errors(ports, "malformed") > before
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert all(len(r.getMessage()) < 400 for r in caplog.records)


async def test_rejected_handshakes_write_one_line_per_source_and_reason(ports, caplog):
    caplog.set_level(logging.WARNING)
    for _ in range(30):
        step1 = json.dumps(HandshakeInitiator(b"not-the-pool-key", peer_hello()).step1()).encode()
        assert status_of(await exchange(ports, post("/v1/handshake", step1, "Connection: close\r\n"))) == 403
    rejected = ports.sidecar.registry.get_sample_value("kv_offload_handshakes_total",
                                                       {"result": "rejected", "reason": "other_pool"})
    assert rejected == 30
    lines = [r for r in caplog.records if "other_pool" in r.getMessage()]
    assert len(lines) == 1 and "127.0.0.2" in lines[0].getMessage()


JSON_BOMBS = {
    "nested 5000 deep": b"[" * 5000 + b"]" * 5000,
    "integer of 5000 digits": b'{"step": "hello", "nonce": ' + b"9" * 5000 + b"}",
    "NaN": b'{"step": NaN}',
    "not UTF-8": b'{"step": "\xff"}',
}


@pytest.mark.parametrize("body", JSON_BOMBS.values(), ids=JSON_BOMBS.keys())
async def test_a_json_bomb_in_a_handshake_is_a_400(ports, body, caplog):
    caplog.set_level(logging.DEBUG)
    answer = await exchange(ports, post("/v1/handshake", body, "Connection: close\r\n"))
    assert status_of(answer) == 400
    assert errors(ports, "malformed") == 1
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_handshake_body_over_its_limit_is_413_before_it_is_read(ports):
    reader, writer = await connect(ports)
    writer.write(post("/v1/handshake", b"x" * (MAX_HANDSHAKE_BODY_BYTES + 1))[:200])  # headers only
    answer = await asyncio.wait_for(reader.read(), PATIENCE)
    writer.close()
    assert status_of(answer) == 413 and errors(ports, "oversize") == 1


async def test_a_long_step_is_clipped_in_the_answer_and_the_log(ports, caplog):
    caplog.set_level(logging.DEBUG)
    answer = await exchange(ports, post("/v1/handshake", json.dumps({"step": "x" * 20_000}).encode(),
                                        "Connection: close\r\n"))
    assert status_of(answer) == 400 and len(answer) < 1024
    assert json.loads(body_of(answer))["reason"] == "malformed"
    assert caplog.records and all(len(r.getMessage()) < 400 for r in caplog.records)


async def test_every_answer_says_server_kv_offload_without_versions(ports):
    for data in (b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                 b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                 b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                 UNPARSEABLE["300 headers"]):
        assert header(await exchange(ports, data), "Server") == "kv-offload"


async def test_public_metrics_show_the_fingerprint_but_not_the_model_dtype_or_wire_version(ports):
    answer = await exchange(ports, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    info = [line for line in body_of(answer).decode().splitlines()
            if line.startswith("kv_offload_config_info{")]
    assert len(info) == 1 and f'fingerprint="{example_config().fingerprint}"' in info[0]
    assert 'transport="tcp"' in info[0]
    for private in ("model=", "dtype=", "wire_version=", "Qwen"):
        assert private not in info[0]
