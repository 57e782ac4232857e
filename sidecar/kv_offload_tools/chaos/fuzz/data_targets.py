"""Fuzz targets of the data plane: raw bytes before authentication, frame streams after it.

``data_preauth``: before authentication nothing but an ERROR frame may come
back, and a complete frame ends the connection. ``data_frames``:
``model_stream`` parses the stream as a correct server must and lists the
answers it owes (LOOKUP_REPLY counts, CHUNK / CHUNK_MISSING per key, ERROR and
close at the first bad frame, close at CLOSE); the replies are checked against
that list, every chunk byte for byte.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.store.checksum import chunk_checksum

from kv_offload_tools.chaos.chunks import chunk_content
from kv_offload_tools.chaos.fuzz.context import (
    HELD_PREFIX,
    REPLY_TIMEOUT,
    FuzzContext,
    FuzzFailure,
    held_keys,
    held_prefix,
)
from kv_offload_tools.chaos.fuzz.strategies import known_key_lists
from kv_offload_tools.chaos.probes import RawDataConnection

# One frame, each header field right or wrong: (magic, major, type, request id, payload,
# stated length or None for the true one).
frame_parts = st.tuples(
    st.one_of(st.just(proto.MAGIC), st.binary(min_size=2, max_size=2)),
    st.one_of(st.just(proto.WIRE_MAJOR), st.integers(0, 255)),
    st.one_of(st.sampled_from([int(t) for t in proto.MessageType]), st.integers(0, 255)),
    st.integers(0, 2 ** 32 - 1),
    st.one_of(known_key_lists.map(lambda ks: proto.encode_keys(ks)), st.binary(max_size=80)),
    st.one_of(st.none(), st.integers(0, 2 ** 64 - 1), st.integers(0, 100)))
# A well-formed request: (LOOKUP or FETCH, request id, keys).
valid_requests = st.tuples(
    st.sampled_from([proto.MessageType.LOOKUP, proto.MessageType.FETCH]),
    st.integers(0, 2 ** 32 - 1), known_key_lists.filter(lambda ks: len(ks) <= 8))


def _frame_bytes(part: Any) -> bytes:
    if isinstance(part, tuple) and isinstance(part[0], proto.MessageType):
        mtype, rid, keys = part
        return b"".join(proto.encode_lookup(rid, keys) if mtype is proto.MessageType.LOOKUP
                        else proto.encode_fetch(rid, keys))
    magic, major, mtype, rid, payload, length = part
    n = len(payload) if length is None else length
    return proto.HEADER.pack(magic, major, mtype, rid, n) + payload


# What a case sends: after authentication, a few frames; before it, bytes or frames.
data_streams = st.lists(st.one_of(valid_requests, valid_requests, frame_parts), min_size=1, max_size=5)
preauth_streams = st.one_of(
    st.binary(min_size=1, max_size=100),
    st.lists(frame_parts, min_size=1, max_size=2).map(lambda ps: b"".join(map(_frame_bytes, ps))))


@dataclass
class _Expected:
    """What a correct server answers to a byte stream (a model of the protocol)."""

    # Replies in order: ("lookup", rid, count) or ("chunk", rid, key) or ("missing", rid, key).
    replies: list[tuple[str, int, Any]]
    # "error" (a complete bad frame), "close" (CLOSE sent), "incomplete" or "open".
    ending: str


def model_stream(stream: bytes, chunk_bytes: int, extra_held: set[bytes] | frozenset[bytes] = frozenset()
                 ) -> _Expected:
    """Parse ``stream`` as the server must and list the answers it owes."""
    replies: list[tuple[str, int, Any]] = []
    pos = 0
    held = set(held_keys()) | set(extra_held)
    while True:
        if pos == len(stream):
            return _Expected(replies, "open")
        if pos + proto.HEADER_BYTES > len(stream):
            return _Expected(replies, "incomplete")
        try:
            header = proto.decode_header(stream[pos:pos + proto.HEADER_BYTES], chunk_bytes)
        except proto.ProtocolError:
            return _Expected(replies, "error")
        pos += proto.HEADER_BYTES
        if header.type is not proto.MessageType.CHUNK:
            if pos + header.length > len(stream):
                return _Expected(replies, "incomplete")
            payload = stream[pos:pos + header.length]
            pos += header.length
        else:
            return _Expected(replies, "error")
        if header.type is proto.MessageType.CLOSE:
            return _Expected(replies, "close")
        if header.type not in (proto.MessageType.LOOKUP, proto.MessageType.FETCH):
            return _Expected(replies, "error")
        try:
            keys = proto.decode_keys(payload)
        except proto.ProtocolError:
            return _Expected(replies, "error")
        if header.type is proto.MessageType.LOOKUP:
            replies.append(("lookup", header.request_id, held_prefix(keys, held)))
        else:
            for i, key in enumerate(keys):
                rid = (header.request_id + i) % proto.REQUEST_ID_MOD
                replies.append(("chunk" if key in held else "missing", rid, key))


def _read_frames(conn: RawDataConnection, want: int, wait_close: bool, linger: float) -> tuple[list, str]:
    """Frames until ``want`` replies (and the close, if expected) or silence; returns (frames, end)."""
    frames: list[tuple[proto.Header, bytes]] = []
    end_time = time.monotonic() + REPLY_TIMEOUT
    while True:
        remaining = end_time - time.monotonic()
        if len(frames) >= want and not wait_close:
            conn.sock.settimeout(linger)
        else:
            conn.sock.settimeout(max(0.01, remaining))
        try:
            head = conn.read_exact(proto.HEADER_BYTES)
        except socket.timeout:
            if len(frames) >= want and not wait_close:
                return frames, "open"
            return frames, "timeout"
        except (ConnectionError, OSError):
            return frames, "closed"
        header = proto.decode_header(head)
        conn.sock.settimeout(REPLY_TIMEOUT)
        payload = conn.read_exact(header.length)
        frames.append((header, payload))
        if header.type is proto.MessageType.ERROR:
            wait_close = True


def _check_replies(frames: list[tuple[proto.Header, bytes]], expected: _Expected, chunk_bytes: int,
                   allow_truncated: bool) -> int:
    """Every reply is right and in order; returns how many of the expected replies came."""
    got = [f for f in frames if f[0].type is not proto.MessageType.ERROR]
    if len(got) > len(expected.replies) or (not allow_truncated and len(got) != len(expected.replies)):
        raise FuzzFailure(f"{len(got)} replies for {len(expected.replies)} expected")
    for (header, payload), (kind, rid, value) in zip(got, expected.replies):
        if header.request_id != rid:
            raise FuzzFailure(f"reply request id {header.request_id} != {rid}")
        if kind == "lookup":
            if header.type is not proto.MessageType.LOOKUP_REPLY or \
                    proto.decode_lookup_reply(payload, 1 << 20) != value:
                raise FuzzFailure(f"LOOKUP answered {header.type.name} {payload!r}, expected {value}")
        elif kind == "missing":
            if header.type is not proto.MessageType.CHUNK_MISSING or proto.decode_chunk_missing(payload) != value:
                raise FuzzFailure(f"expected CHUNK_MISSING for {value.hex()}, got {header.type.name}")
        else:
            if header.type is not proto.MessageType.CHUNK:
                raise FuzzFailure(f"expected CHUNK {value.hex()}, got {header.type.name}")
            prefix = proto.decode_chunk_prefix(payload)
            data = payload[prefix.size:]
            known = value.startswith(HELD_PREFIX)  # fuzz-committed chunks hold unknown bytes
            if prefix.key != value or len(data) != chunk_bytes or chunk_checksum(data) != prefix.checksum \
                    or (known and data != chunk_content(value, chunk_bytes)):
                raise FuzzFailure(f"CHUNK {value.hex()} arrived wrong")
    return len(got)


def run_data_case(ctx: FuzzContext, case: list) -> str:
    stream = b"".join(_frame_bytes(p) for p in case)
    chunk_bytes = ctx.pool.chunk_bytes
    expected = model_stream(stream, chunk_bytes, ctx.extra_held)
    with RawDataConnection(ctx.data_address, timeout=REPLY_TIMEOUT) as conn:
        conn.authenticate(ctx.session)
        conn.send(stream)
        wait_close = expected.ending in ("error", "close")
        frames, end = _read_frames(conn, len(expected.replies), wait_close,
                                   0.05 if expected.ending == "incomplete" else 0.01)
    errors = [f for f in frames if f[0].type is proto.MessageType.ERROR]
    if expected.ending == "error":
        if end != "closed" or not errors or frames[-1][0].type is not proto.MessageType.ERROR:
            raise FuzzFailure(f"a bad frame did not end in ERROR + close (end={end}, "
                              f"{[f[0].type.name for f in frames]})")
        _check_replies(frames, expected, chunk_bytes, allow_truncated=True)
        return "error"
    if errors:
        raise FuzzFailure(f"valid frames got an ERROR: {errors[0][1][:200]!r}")
    if end == "timeout":
        raise FuzzFailure(f"no answer within {REPLY_TIMEOUT}s ({len(frames)} of {len(expected.replies)})")
    _check_replies(frames, expected, chunk_bytes, allow_truncated=expected.ending == "close")
    if expected.ending == "close" and end != "closed":
        raise FuzzFailure("CLOSE did not close the connection")
    return "incomplete" if expected.ending == "incomplete" else "answer"


def run_preauth_case(ctx: FuzzContext, case: bytes) -> str:
    with RawDataConnection(ctx.data_address, timeout=REPLY_TIMEOUT) as conn:
        conn.read_challenge()
        conn.send(case)
        complete = _first_frame_complete(case, ctx.pool.chunk_bytes)
        frames, end = _read_frames(conn, 0, complete, 0.05)
    for header, _ in frames:
        if header.type is not proto.MessageType.ERROR:
            raise FuzzFailure(f"before authentication the server sent {header.type.name}")
    if complete:
        if end != "closed" or not frames:
            raise FuzzFailure(f"a complete unauthenticated frame got no ERROR + close ({end})")
        return "error"
    return "incomplete"


def _first_frame_complete(stream: bytes, chunk_bytes: int) -> bool:
    """True when the server has enough bytes to judge the first frame."""
    if len(stream) < proto.HEADER_BYTES:
        return False
    try:
        header = proto.decode_header(stream[:proto.HEADER_BYTES], chunk_bytes)
    except proto.ProtocolError:
        return True
    if header.type is proto.MessageType.CHUNK:
        return True
    return len(stream) - proto.HEADER_BYTES >= header.length
