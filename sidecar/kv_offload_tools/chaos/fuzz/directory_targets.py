"""Fuzz targets of the chunk directory's endpoints: ``POST /v1/publish`` and ``/v1/locate``.

``directory``: bodies with no session, an unknown session, a wrong or
missing HMAC, or the HMAC of another operation: every one is a 401 with a
JSON error, and nothing is applied. ``directory_session``: an authenticated
peer (the context's session) sends arbitrary bodies with the right HMAC: a
body that ``PublishBatch``/``LocateQuery`` accept gets a well-formed reply,
anything else a 400 with a JSON error; a locate names exactly the fuzzed
sidecar for the chunks it holds and nobody for the others (the asker is never
named to itself, whatever it published).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import strategies as st
from kv_offload_sidecar.peers.links import AUTH_HEADER, SESSION_HEADER
from kv_offload_sidecar.peers.directory.location_wire import (
    LocateQuery,
    LocateReply,
    PublishBatch,
    PublishReply,
    key_digest,
    location_auth,
)

from kv_offload_tools.chaos.fuzz.context import FuzzContext, FuzzFailure, expect_json_error, held_keys
from kv_offload_tools.chaos.fuzz.strategies import json_values

OPS = ("publish", "locate")
_digest = st.one_of(st.integers(0, (1 << 64) - 1),
                    st.integers(0, 7).map(lambda i: key_digest(held_keys()[i])))
_b64 = st.one_of(st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode()),
                 st.lists(_digest, max_size=6).map(
                     lambda ds: base64.b64encode(b"".join(d.to_bytes(8, "big") for d in ds)).decode()),
                 st.lists(st.tuples(_digest, st.integers(0, (1 << 32) - 1)), max_size=6).map(
                     lambda r: base64.b64encode(b"".join(d.to_bytes(8, "big") + t.to_bytes(4, "big")
                                                         for d, t in r)).decode()),
                 st.text(max_size=12), st.integers(), st.none())
_publish_bodies = st.fixed_dictionaries(
    {"epoch": st.one_of(st.sampled_from(["ab", "0f1e"]), st.text(max_size=70), st.integers()),
     "seq": st.one_of(st.integers(-3, 6), st.integers(0, 2 ** 70), st.booleans(), st.text(max_size=4)),
     "adds": _b64, "removes": _b64},
    optional={"reset": st.one_of(st.booleans(), st.integers(0, 1), st.none()),
              "resync_me": st.one_of(st.booleans(), st.text(max_size=3))})
_locate_bodies = st.fixed_dictionaries({"digests": _b64})
_bodies = st.one_of(_publish_bodies.map(json.dumps), _locate_bodies.map(json.dumps),
                    json_values.map(json.dumps), st.binary(max_size=80))

directory_cases = st.tuples(
    st.sampled_from(OPS), _bodies,
    st.one_of(st.none(), st.text(max_size=40), st.binary(min_size=16, max_size=16).map(bytes.hex)),
    st.one_of(st.none(), st.just("other-op"), st.text(max_size=70)))


def _send(ctx: FuzzContext, op: str, raw: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    return ctx.http.request("POST", f"/v1/{op}", raw, headers={"Content-Type": "application/json",
                                                                **headers})


def run_directory_case(ctx: FuzzContext, case: tuple) -> str:
    """Without a valid session and HMAC: always 401, never an answer."""
    op, body, session, auth = case
    raw = body if isinstance(body, bytes) else body.encode()
    headers = {}
    if session is not None and session.isascii() and session.isprintable():
        headers[SESSION_HEADER] = session
    if auth == "other-op":  # the real session with the HMAC of the other operation
        headers[SESSION_HEADER] = ctx.session.session_id.hex()
        other = OPS[1 - OPS.index(op)]
        headers[AUTH_HEADER] = location_auth(ctx.session.session_key, other, raw)
    elif auth is not None and auth.isascii() and auth.isprintable():
        headers[AUTH_HEADER] = auth
    status, data = _send(ctx, op, raw, headers)
    if status != 401:
        raise FuzzFailure(f"a {op} without a valid session and HMAC got HTTP {status}: {data[:200]!r}")
    expect_json_error(status, data, f"{op} without a session")
    return "error"


directory_session_cases = st.tuples(st.sampled_from(OPS), _bodies)


def _parsed(op: str, raw: bytes) -> Any:
    """The message the sidecar should accept, or None when it must refuse the body."""
    try:
        body = json.loads(raw.decode("utf-8"))
        return PublishBatch.from_dict(body) if op == "publish" else LocateQuery.from_dict(body)
    except (UnicodeDecodeError, ValueError):
        return None


def run_directory_session_case(ctx: FuzzContext, case: tuple) -> str:
    """An authenticated peer: a valid body gets the right reply, anything else a 400."""
    op, body = case
    raw = body if isinstance(body, bytes) else body.encode()
    headers = {SESSION_HEADER: ctx.session.session_id.hex(),
               AUTH_HEADER: location_auth(ctx.session.session_key, op, raw)}
    status, data = _send(ctx, op, raw, headers)
    message = _parsed(op, raw)
    if message is None:
        if status != 400:
            raise FuzzFailure(f"an invalid {op} body got HTTP {status} (want 400): {raw[:120]!r}")
        expect_json_error(status, data, f"invalid {op} body")
        return "error"
    if status != 200:
        raise FuzzFailure(f"a valid {op} got HTTP {status}: {data[:200]!r}")
    try:
        answer = json.loads(data)
        if op == "publish":
            PublishReply.from_dict(answer)
            return "answer"
        reply = LocateReply.from_dict(answer)
    except ValueError as exc:
        raise FuzzFailure(f"the {op} reply does not parse ({exc}): {data[:200]!r}") from None
    held = {key_digest(k) for k in held_keys()}
    want = [ctx.sidecar.identity] if message.digests[0] in held else []
    if [h.identity for h in reply.holders] != want:
        raise FuzzFailure(f"locate of a {'held' if want else 'foreign'} chunk named {reply.holders}")
    return "answer"
