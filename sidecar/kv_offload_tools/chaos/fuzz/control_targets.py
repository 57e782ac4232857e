"""Fuzz targets of the control plane: handshake steps, summary pulls, admin lookups (HTTP).

``handshake``: a hello must be accepted exactly when a pool member's hello
would be (and then carry a server proof that verifies with the pool key), and
refused for the reason ``compare_hello`` gives otherwise; anything else is a
clean 4xx. ``summary``: without a session every pull is refused. ``lookup``:
a valid body is answered with the held prefix, anything else with a 4xx.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any
from urllib.parse import urlencode

from hypothesis import strategies as st
from kv_offload_sidecar.control.app import MAX_LOOKUP_KEYS
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HelloMessage,
    compare_hello,
    server_proof,
)

from kv_offload_tools.chaos.fuzz.context import (
    FuzzContext,
    FuzzFailure,
    expect_json_error,
    held_prefix,
    valid_keys,
    valid_timeout,
)
from kv_offload_tools.chaos.fuzz.strategies import (
    hex_items,
    json_values,
    odd_digits,
    timeouts,
)

# Seconds the handshake responder remembers a used client nonce (handshake.py: max(ttl, 60)).
# A step 1 replayed later is answered again; it is harmless, since step 2 needs the pool key
# and a fresh, single-use server nonce.
REPLAY_WINDOW_SECONDS = 60.0


def _hello_template(ctx: FuzzContext) -> dict[str, Any]:
    return ctx.pool.local_hello(identity="fuzzer").to_dict()


@st.composite
def handshake_cases(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["hello", "hello", "hello", "proof", "json", "bytes", "big"]))
    if kind == "hello":
        edits = draw(st.lists(st.tuples(
            st.sampled_from(["wire_version", "fingerprint", "hash_seed", "kv_bytes_per_chunk", "identity",
                             "control_address", "data_address", "transport", "nonce", "run_config", "extra"]),
            st.sampled_from(["drop", "json", "text", "int", "long"]),
            json_values, st.one_of(st.text(max_size=30), odd_digits), st.integers(-(2 ** 65), 2 ** 65)),
            max_size=3))
        nonce = draw(st.binary(min_size=16, max_size=16)).hex()
        step = draw(st.one_of(st.just("hello"), st.just("hello"), st.sampled_from(["proof", "", "HELLO"]),
                              json_values))
        return "hello", {"edits": edits, "nonce": nonce, "step": step}
    if kind == "proof":
        return "proof", {"step": "proof",
                         "nonce_client": draw(st.binary(min_size=0, max_size=20).map(bytes.hex) | json_values),
                         "nonce_server": draw(st.binary(min_size=16, max_size=16).map(bytes.hex) | json_values),
                         "proof": draw(st.text(max_size=130) | json_values)}
    if kind == "json":
        return "raw", json.dumps(draw(json_values)).encode()
    if kind == "big":
        return "raw", b'{"step": "hello", "pad": "' + b"x" * 70000 + b'"}'
    return "raw", draw(st.binary(max_size=300))


def _apply_edits(hello: dict[str, Any], edits: list[tuple]) -> dict[str, Any]:
    out = dict(hello)
    for name, action, jv, text, num in edits:
        if action == "drop":
            out.pop(name, None)
        elif action == "json":
            out[name] = jv
        elif action == "text":
            out[name] = text
        elif action == "int":
            out[name] = num
        else:
            out[name] = "y" * 5000
    return out


def run_handshake_case(ctx: FuzzContext, case: tuple[str, Any]) -> str:
    kind, payload = case
    if kind == "hello":
        hello = _apply_edits(dict(_hello_template(ctx), nonce=payload["nonce"]), payload["edits"])
        body = {"step": payload["step"], "hello": hello}
        status, data = ctx.http.request("POST", "/v1/handshake", json.dumps(body).encode())
        expected = _expected_hello_outcome(ctx, body, hello)
        if expected == "either":
            expected = "accept" if status == 200 else "replay"
        if expected == "accept":
            if status != 200:
                raise FuzzFailure(f"a compatible hello was refused: HTTP {status} {data[:300]!r}")
            reply = json.loads(data)
            server = HelloMessage.from_dict(reply.get("hello"))
            client = HelloMessage.from_dict(hello)
            if not hmac.compare_digest(reply.get("proof", ""), server_proof(ctx.pool.pool_key, client, server)):
                raise FuzzFailure("the server's proof does not verify with the pool key")
            ctx.seen_nonces[client.nonce] = time.monotonic()
            return "answer"
        expect_json_error(status, data, f"hello expected {expected}")
        reason = json.loads(data).get("reason")
        if expected != "malformed-step" and reason != expected:
            raise FuzzFailure(f"hello refused for {reason!r}, expected {expected!r}: {data[:300]!r}")
        return "error"
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    try:
        status, data = ctx.http.request("POST", "/v1/handshake", raw)
    except ConnectionError:
        if len(raw) > 64 * 1024:  # an oversized body may be cut off after the 413 is sent
            return "error"
        raise
    expect_json_error(status, data, f"handshake {kind}")
    return "error"


def _expected_hello_outcome(ctx: FuzzContext, body: dict[str, Any], hello: dict[str, Any]) -> str:
    if body["step"] != "hello":
        return "malformed-step"
    try:
        remote = HelloMessage.from_dict(hello)
    except (HandshakeError, TypeError):
        return "malformed"
    except Exception:  # a value the parser itself trips on: the server must still refuse it cleanly
        return "malformed-step"
    local = ctx.pool.local_hello(identity=ctx.sidecar.identity)
    try:
        verdict = compare_hello(local, remote)
    except Exception:  # an odd run_config the diff cannot read: the server must still refuse cleanly
        return "malformed-step"
    if verdict is not None:
        return verdict[0]
    seen = ctx.seen_nonces.get(remote.nonce)
    if seen is not None:
        age = time.monotonic() - seen
        if age < REPLAY_WINDOW_SECONDS - 10:
            return "replay"
        if age < REPLAY_WINDOW_SECONDS + 10:
            return "either"  # at the edge of the server's replay window
    return "accept"


summary_cases = st.tuples(
    st.one_of(st.integers(-5, 2 ** 70).map(str), st.text(max_size=25), odd_digits),
    st.text(max_size=70),
    st.one_of(st.none(), st.text(max_size=40), st.binary(min_size=16, max_size=16).map(bytes.hex)),
    st.one_of(st.none(), st.text(max_size=70)))


def run_summary_case(ctx: FuzzContext, case: tuple) -> str:
    since, epoch, session, auth = case
    headers = {}
    for name, value in (("X-KV-Offload-Session", session), ("X-KV-Offload-Auth", auth)):
        if value is not None and value.isprintable() and value.isascii():
            headers[name] = value
    status, data = ctx.http.request("GET", "/v1/summary?" + urlencode({"since": since, "epoch": epoch}),
                                    headers=headers)
    expect_json_error(status, data, "summary without a session")
    return "error"


lookup_cases = st.one_of(
    st.fixed_dictionaries({"keys": hex_items}, optional={"timeout": timeouts}),
    json_values.map(lambda v: ("json", v)),
    st.binary(max_size=200).map(lambda b: ("bytes", b)))




def run_lookup_case(ctx: FuzzContext, case: Any) -> str:
    if isinstance(case, tuple):
        raw = case[1] if case[0] == "bytes" else json.dumps(case[1]).encode()
        status, data = ctx.http.request("POST", "/v1/lookup", raw)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            expect_json_error(status, data, "lookup body that is not JSON")
            return "error"
        return _check_lookup_answer(ctx, body, status, data)
    status, data = ctx.http.request("POST", "/v1/lookup", json.dumps(case).encode())
    return _check_lookup_answer(ctx, case, status, data)


def _check_lookup_answer(ctx: FuzzContext, body: Any, status: int, data: bytes) -> str:
    keys = valid_keys(body.get("keys"), MAX_LOOKUP_KEYS) if isinstance(body, dict) else None
    good = keys is not None and valid_timeout(body.get("timeout"), "timeout" in body)
    if not good:
        expect_json_error(status, data, f"invalid lookup {json.dumps(body)[:120]}")
        return "error"
    if status != 200:
        raise FuzzFailure(f"a valid lookup got HTTP {status}: {data[:200]!r}")
    reply = json.loads(data)
    assert keys is not None
    want = held_prefix(keys, ctx.extra_held)
    if reply != {"local": want, "peer": 0}:
        raise FuzzFailure(f"lookup answered {reply} for keys whose held prefix is {want}")
    return "answer"
