"""Fuzz target of the local channel: frames on the engine's Unix socket.

Every request gets exactly one reply with ``ok``; a malformed frame (broken
JSON, a lying length, no ``op``) gets a refusal and the channel closes. The
oracle tracks the reservations and loads a case opened, so commit, abort and
release are judged against them, and keys a case committed join the held set.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from hypothesis import strategies as st
from kv_offload_sidecar.engine.channel_protocol import LENGTH, MAX_FRAME_BYTES, MAX_KEYS

from kv_offload_tools.chaos.fuzz.context import (
    REPLY_TIMEOUT,
    FuzzContext,
    FuzzFailure,
    held_keys,
    held_prefix,
    valid_keys,
    valid_timeout,
)
from kv_offload_tools.chaos.fuzz.strategies import (
    hex_items,
    json_values,
    known_key_lists,
    timeouts,
)

# Requests the sidecar should answer (ids 1-4 name reservations and loads the case may hold).
well_formed_local = st.one_of(
    st.fixed_dictionaries({"op": st.sampled_from(["lookup", "load", "reserve"]),
                           "keys": known_key_lists.map(lambda ks: [k.hex() for k in ks]),
                           "timeout": st.sampled_from([0.2, 1.0])}),
    st.fixed_dictionaries({"op": st.sampled_from(["commit", "abort", "release", "info"]),
                           "id": st.integers(1, 4)}))
# One request: well formed, any fields, any JSON ("json"), any bytes ("bytes"), or a length
# prefix beyond the frame limit ("length").
local_requests = st.one_of(
    well_formed_local, well_formed_local,
    st.fixed_dictionaries(
        {"op": st.sampled_from(["info", "lookup", "reserve", "commit", "abort", "load", "release",
                                "LOOKUP", "", "drop"])},
        optional={"keys": hex_items, "timeout": timeouts,
                  "id": st.one_of(st.integers(-2, 5), json_values),
                  "written": st.one_of(st.lists(st.booleans(), max_size=6), json_values)}),
    json_values.map(lambda v: ("json", v)),
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    st.integers(MAX_FRAME_BYTES + 1, 2 ** 32 - 1).map(lambda n: ("length", n)))
# A case: a few requests on one connection.
local_cases = st.lists(local_requests, min_size=1, max_size=4)


def _local_recv(sock: socket.socket) -> dict[str, Any] | None:
    """One reply frame, or None when the sidecar closed the channel."""
    head = b""
    while len(head) < 4:
        part = sock.recv(4 - len(head))
        if not part:
            return None
        head += part
    (n,) = LENGTH.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise FuzzFailure(f"local channel reply claims {n} bytes")
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise FuzzFailure("local channel closed inside a reply")
        data += part
    reply = json.loads(data)
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise FuzzFailure(f"local channel reply without 'ok': {reply!r}")
    if not reply["ok"] and not (isinstance(reply.get("error"), str) and reply["error"]):
        raise FuzzFailure(f"local channel refusal without an error message: {reply!r}")
    return reply


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _strict_json(value: Any) -> bool:
    """Whether ``value`` is JSON as the channel reads it (no NaN or Infinity)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def run_local_case(ctx: FuzzContext, case: list) -> str:
    outcome = "answer"
    reservations: dict[int, list[bytes | None]] = {}  # id -> reserved key per position (None: no slot)
    loads: set[int] = set()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT)
        sock.connect(ctx.socket_path)
        for req in case:
            fatal = False
            if isinstance(req, tuple) and req[0] == "length":
                sock.sendall(LENGTH.pack(req[1]))
                fatal = True
            elif isinstance(req, tuple):
                raw = req[1] if req[0] == "bytes" else json.dumps(req[1]).encode()
                sock.sendall(LENGTH.pack(len(raw)) + raw)
                try:
                    parsed = json.loads(raw, parse_constant=_not_json)
                except (ValueError, UnicodeDecodeError):
                    parsed = None
                    fatal = True
                if not isinstance(parsed, dict) or not isinstance(parsed.get("op"), str):
                    fatal = True
                else:
                    req = parsed
            else:
                raw = json.dumps(req).encode()
                sock.sendall(LENGTH.pack(len(raw)) + raw)
                # NaN and Infinity are Python's, not JSON's: the channel refuses such a frame.
                fatal = not _strict_json(req)
            try:
                reply = _local_recv(sock)
            except socket.timeout:
                raise FuzzFailure(f"no local channel reply within {REPLY_TIMEOUT}s to {str(req)[:200]}") from None
            if reply is None:
                raise FuzzFailure(f"local channel closed without a reply to {str(req)[:200]}")
            if fatal:
                if reply["ok"]:
                    raise FuzzFailure(f"a malformed frame got ok: {reply!r}")
                if _local_recv(sock) is not None:
                    raise FuzzFailure("the channel stayed open after a malformed frame")
                return "error"
            result = _judge_local(ctx, req, reply, reservations, loads)
            if result == "error":
                outcome = "error" if outcome == "answer" else outcome
    return outcome


def _judge_local(ctx: FuzzContext, req: dict[str, Any], reply: dict[str, Any],
                 reservations: dict[int, list[bytes | None]], loads: set[int]) -> str:
    op = req.get("op")
    keys = valid_keys(req.get("keys"), MAX_KEYS)
    timeout_ok = valid_timeout(req.get("timeout"), "timeout" in req) and req.get("timeout", 1) is not None
    rid = req.get("id")
    id_ok = isinstance(rid, int) and not isinstance(rid, bool)
    expect_ok: bool
    if op == "info":
        expect_ok = True
    elif op in ("lookup", "load"):
        expect_ok = keys is not None and timeout_ok
    elif op == "reserve":
        expect_ok = keys is not None
    elif op in ("commit", "abort"):
        written = req.get("written")
        expect_ok = id_ok and rid in reservations and (
            op == "abort" or written is None
            or (isinstance(written, list) and len(written) == len(reservations[rid])))
    elif op == "release":
        expect_ok = id_ok and rid in loads
    else:
        expect_ok = False
    if reply["ok"] != expect_ok:
        raise FuzzFailure(f"local op {op!r} answered ok={reply['ok']} (expected {expect_ok}): "
                          f"request {json.dumps(req)[:200]} reply {json.dumps(reply)[:200]}")
    if not expect_ok:
        if op in ("commit", "abort") and id_ok:
            reservations.pop(rid, None)  # a bad 'written' still gives the reservation back
        return "error"
    if op == "info":
        if reply.get("store", {}).get("num_slots") != ctx.num_slots:
            raise FuzzFailure(f"info answered {reply!r}")
    elif op == "lookup":
        assert keys is not None
        want = held_prefix(keys, ctx.extra_held)
        if (reply.get("local"), reply.get("peer")) != (want, 0):
            raise FuzzFailure(f"lookup answered {reply} for held prefix {want}")
    elif op == "load":
        assert keys is not None
        slots = reply.get("slots")
        want = held_prefix(keys, ctx.extra_held)
        if not isinstance(slots, list) or len(slots) != want:
            raise FuzzFailure(f"load answered {reply} for held prefix {want}")
        if slots:  # a load that pinned nothing has nothing to release (its id is not kept)
            loads.add(reply["id"])
    elif op == "reserve":
        assert keys is not None
        slots = reply.get("slots")
        if not isinstance(slots, list) or len(slots) != len(keys):
            raise FuzzFailure(f"reserve answered {reply} for {len(keys)} keys")
        for k, slot in zip(keys, slots):
            if (k in set(held_keys()) or k in ctx.extra_held) and slot is not None:
                raise FuzzFailure(f"reserve handed out a slot for a held key: {reply}")
            if slot is not None and not (isinstance(slot, int) and 0 <= slot < ctx.num_slots):
                raise FuzzFailure(f"reserve answered slot {slot!r}")
        reservations[reply["id"]] = [k if slot is not None else None for k, slot in zip(keys, slots)]
    elif op in ("commit", "abort"):
        reserved = reservations.pop(rid, [])
        if op == "commit":
            written = req.get("written")
            for i, k in enumerate(reserved):
                if k is not None and (written is None or written[i] is True):
                    ctx.extra_held.add(k)
    elif op == "release":
        loads.discard(rid)
    return "answer"
