"""Fuzz targets of the control plane: handshake steps, admin lookups (HTTP).

``handshake``: step 1 bodies (mutated versions, nonces, key ids) must get a
server nonce and the pool's key id exactly when a member's would, whatever wire
version they name, and the refusal ``step1_oracle`` predicts otherwise; step 2 bodies from a key
holder with a mutated hello must be accepted exactly when ``compare_hello``
accepts (and then carry a server proof that verifies), refused for its reason
otherwise; step 2 with a wrong proof is ``bad_proof`` without any field diff;
anything else is a clean 4xx (the directory's messages are ``directory_targets``). ``lookup``: an admin's
valid body is answered with the held prefix, anything else with a 4xx, and a
caller without the admin token gets the same 401 whatever it asks.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from hypothesis import strategies as st
from kv_offload_sidecar.control.app import MAX_LOOKUP_KEYS
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HandshakeInitiator,
    HelloMessage,
    _wire_major,
    client_proof,
    compare_hello,
    server_proof,
    transcript,
)
from kv_offload_sidecar.peers.pool_keys import KEY_ID_BYTES, MAX_OFFERED_KEYS, key_id

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
HELLO_FIELDS = ["wire_version", "fingerprint", "hash_seed", "kv_bytes_per_chunk", "identity",
                "control_address", "data_address", "transport", "run_config", "extra"]
STEP1_FIELDS = ["wire_version", "nonce", "key_ids", "step", "extra"]


def _edits(fields: list[str]) -> st.SearchStrategy:
    return st.lists(st.tuples(
        st.sampled_from(fields),
        st.sampled_from(["drop", "json", "text", "int", "long", "hexlist", "version"]),
        json_values, st.one_of(st.text(max_size=30), odd_digits), st.integers(-(2 ** 65), 2 ** 65)),
        max_size=3)


@st.composite
def handshake_cases(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["step1", "step1", "step2", "step2", "badproof", "proof", "json",
                                 "bytes", "big"]))
    if kind == "step1":
        return "step1", {"edits": draw(_edits(STEP1_FIELDS)),
                         "nonce": draw(st.binary(min_size=16, max_size=16)).hex()}
    if kind in ("step2", "badproof"):
        return kind, {"edits": draw(_edits(HELLO_FIELDS))}
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


def _apply_edits(body: dict[str, Any], edits: list[tuple]) -> dict[str, Any]:
    out = dict(body)
    for name, action, jv, text, num in edits:
        if action == "drop":
            out.pop(name, None)
        elif action == "json":
            out[name] = jv
        elif action == "text":
            out[name] = text
        elif action == "int":
            out[name] = num
        elif action == "hexlist":
            out[name] = [text.encode().hex()]
        elif action == "version":  # a well-formed "major.minor", mostly not this sidecar's
            out[name] = f"{abs(num) % 12}.{abs(num) % 7}"
        else:
            out[name] = "y" * 5000
    return out


def _post(ctx: FuzzContext, body: Any) -> tuple[int, Any]:
    status, data = ctx.http.request("POST", "/v1/handshake", json.dumps(body).encode())
    try:
        return status, json.loads(data)
    except ValueError:
        raise FuzzFailure(f"handshake answer is not JSON: HTTP {status} {data[:200]!r}") from None


def _expect_refusal(status: int, reply: Any, expected: str, what: str) -> str:
    expect_json_error(status, json.dumps(reply).encode(), what)
    if expected != "any-4xx" and reply.get("reason") != expected:
        raise FuzzFailure(f"{what}: refused for {reply.get('reason')!r}, expected {expected!r}: {reply!r}")
    return "error"


def step1_oracle(ctx: FuzzContext, body: dict[str, Any]) -> str:
    """What the sidecar must answer to a step-1 body: accept, a reason, or any 4xx.

    Which wire version a body names never matters here, only that it reads "major.minor": a
    stranger of any version gets the same ``other_pool``, and a key holder of another version
    is answered like any member and told only after its proof (step 2, ``compare_hello``).
    """
    if body.get("step") != "hello":
        return "any-4xx"
    if _wire_major(body.get("wire_version")) is None:
        return "malformed"
    nonce = body.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 32 or not _is_hex(nonce):
        return "malformed"
    ids = body.get("key_ids")
    if (not isinstance(ids, list) or not 0 < len(ids) <= MAX_OFFERED_KEYS
            or not all(isinstance(k, str) and len(k) == 2 * KEY_ID_BYTES and _is_hex(k) for k in ids)):
        return "malformed"
    if key_id(ctx.pool.pool_key).hex() not in [k.lower() for k in ids]:
        return "other_pool"
    seen = ctx.seen_nonces.get(nonce)
    if seen is not None:
        age = time.monotonic() - seen
        if age < REPLAY_WINDOW_SECONDS - 10:
            return "replay"
        if age < REPLAY_WINDOW_SECONDS + 10:
            return "either"  # at the edge of the server's replay window
    return "accept"


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return text.isascii()


def run_handshake_case(ctx: FuzzContext, case: tuple[str, Any]) -> str:
    kind, payload = case
    if kind == "step1":
        valid = HandshakeInitiator(ctx.pool.pool_key, ctx.pool.local_hello(identity="fuzzer")).step1()
        body = _apply_edits({**valid, "nonce": payload["nonce"]}, payload["edits"])
        status, reply = _post(ctx, body)
        expected = step1_oracle(ctx, body)
        if expected == "either":
            expected = "accept" if status == 200 else "replay"
        if expected != "accept":
            return _expect_refusal(status, reply, expected, "step 1")
        if status != 200 or reply.get("key_id") != key_id(ctx.pool.pool_key).hex() or len(reply) != 5:
            raise FuzzFailure(f"a member's step 1 was not answered with a nonce and the key id: "
                              f"HTTP {status} {reply!r}")
        ctx.seen_nonces[body["nonce"]] = time.monotonic()
        return "answer"
    if kind in ("step2", "badproof"):
        return _run_step2_case(ctx, kind, payload)
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    try:
        status, data = ctx.http.request("POST", "/v1/handshake", raw)
    except ConnectionError:
        if len(raw) > 64 * 1024:  # an oversized body may be cut off after the 413 is sent
            return "error"
        raise
    expect_json_error(status, data, f"handshake {kind}")
    return "error"


def _run_step2_case(ctx: FuzzContext, kind: str, payload: dict[str, Any]) -> str:
    """A key holder (or, for ``badproof``, someone without the key) proves a mutated hello."""
    initiator = HandshakeInitiator(ctx.pool.pool_key, ctx.pool.local_hello(identity="fuzzer"))
    status, reply = _post(ctx, initiator.step1())
    if status != 200:
        raise FuzzFailure(f"a member's step 1 was refused: HTTP {status} {reply!r}")
    step2 = initiator.step2(reply)
    hello = _apply_edits(step2["hello"], payload["edits"])
    nonce_s, kid = bytes.fromhex(step2["nonce_server"]), bytes.fromhex(reply["key_id"])
    try:
        remote = HelloMessage.from_dict(hello)
    except (HandshakeError, TypeError):
        remote = None
    except Exception:  # a value the parser itself trips on: the server must still refuse it cleanly
        remote = None
    proof = "00" * 32 if kind == "badproof" else (
        client_proof(ctx.pool.pool_key, transcript(initiator.nonce, nonce_s, kid, remote)) if remote else "00")
    status, answer = _post(ctx, {**step2, "hello": hello, "proof": proof})
    if remote is None:
        return _expect_refusal(status, answer, "malformed", "step 2 with a malformed hello")
    if kind == "badproof":
        _expect_refusal(status, answer, "bad_proof", "step 2 without the key")
        if answer.get("diff") or answer.get("fields") or "hello" in answer:
            raise FuzzFailure(f"a step 2 without the key learnt about the pool: {answer!r}")
        return "error"
    local = ctx.pool.local_hello(identity=ctx.sidecar.identity).sealed(ctx.pool.pool_key, initiator.nonce,
                                                                       nonce_s)
    try:
        verdict = compare_hello(local, remote)
    except Exception:  # an odd run_config the diff cannot read: the server must still refuse cleanly
        return _expect_refusal(status, answer, "any-4xx", "step 2 with an odd run_config")
    if verdict is not None:
        return _expect_refusal(status, answer, verdict[0], "step 2 of a differing member")
    if status != 200:
        raise FuzzFailure(f"a compatible member's step 2 was refused: HTTP {status} {answer!r}")
    t = transcript(initiator.nonce, nonce_s, kid, remote)  # the mutated hello is what it covered
    try:
        server = HelloMessage.from_dict(answer.get("hello"))
    except HandshakeError as exc:
        raise FuzzFailure(f"the server's acceptance carries a bad hello: {exc}") from None
    if not hmac.compare_digest(str(answer.get("proof")), server_proof(ctx.pool.pool_key, t, server)):
        raise FuzzFailure("the server's proof does not verify with the pool key")
    return "answer"


lookup_cases = st.one_of(
    st.fixed_dictionaries({"keys": hex_items}, optional={"timeout": timeouts}),
    json_values.map(lambda v: ("json", v)),
    st.binary(max_size=200).map(lambda b: ("bytes", b)),
    st.tuples(st.just("noauth"), st.one_of(st.none(), st.text(max_size=80)),
              st.fixed_dictionaries({"keys": hex_items})))




def _admin(ctx: FuzzContext) -> dict[str, str]:
    return {"Authorization": f"Bearer {ctx.pool.admin_token}"}


def run_lookup_case(ctx: FuzzContext, case: Any) -> str:
    if isinstance(case, tuple) and case[0] == "noauth":
        token, body = case[1], case[2]
        headers = {} if token is None or not (token.isascii() and token.isprintable()) else {
            "Authorization": f"Bearer {token}"}
        status, data = ctx.http.request("POST", "/v1/lookup", json.dumps(body).encode(), headers=headers)
        if status != 401 or json.loads(data) != ctx.unauthenticated_lookup_answer:
            raise FuzzFailure(f"a lookup without the admin token got HTTP {status} {data[:200]!r}")
        return "error"
    if isinstance(case, tuple):
        raw = case[1] if case[0] == "bytes" else json.dumps(case[1]).encode()
        status, data = ctx.http.request("POST", "/v1/lookup", raw, headers=_admin(ctx))
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            expect_json_error(status, data, "lookup body that is not JSON")
            return "error"
        return _check_lookup_answer(ctx, body, status, data)
    status, data = ctx.http.request("POST", "/v1/lookup", json.dumps(case).encode(), headers=_admin(ctx))
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
