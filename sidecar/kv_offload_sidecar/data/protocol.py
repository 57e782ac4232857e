"""Binary frames of the data plane (peer sidecar <-> peer sidecar).

Every frame is a 16-byte header followed by ``length`` payload bytes::

    struct "!2sBBIQ": magic b"KO", wire major (1), message type, request id (u32),
                      payload length (u64)

Message types and payloads (all integers big-endian):

- ``AUTH_CHALLENGE`` server -> client: 16-byte nonce.
- ``AUTH_RESPONSE`` client -> server: u16 len + session_id, 32-byte
  HMAC-SHA256(session_key, nonce).
- ``AUTH_OK`` server -> client: empty.
- ``UCX_ATTACH`` client -> server (UCX only, before the challenge): u32 connection
  id (the client's tag base), u16 len + session_id, 32-byte
  HMAC-SHA256(session_key, "kv-offload ucx attach" || connection id || worker
  address), then the client's UCX worker address. The server checks the MAC
  before it creates an endpoint to that address, then runs the nonce challenge.
- ``LOOKUP`` / ``FETCH``: key list = u32 count + count x (u16 len + key bytes).
- ``LOOKUP_REPLY``: u32 number of leading keys the server holds.
- ``CHUNK``: u16 len + key, u64 checksum, then exactly ``chunk_bytes`` bytes.
  The key/checksum part is the "chunk prefix"; the bytes follow it (TCP) or come
  as a separate message (UCX).
- ``CHUNK_MISSING``: u16 len + key.
- ``ERROR``: utf-8 text ``"<reason>: <message>"``.
- ``CLOSE``: empty.
- ``NIXL_METADATA``, ``CHUNK_AT``, ``RELEASE``: the NIXL transport's frames (payloads in
  ``data.nixl.frames``): the holder's sealed agent metadata after AUTH_OK; a chunk's key,
  checksum and slot, pinned for the fetcher's one-sided READ; the request ids it is done with.

A FETCH of n keys with request id r is answered by one CHUNK or CHUNK_MISSING per
key, in order, with request ids r, r+1, ... r+n-1 (mod 2**32).

Until AUTH_OK no frame either way carries more than ``MAX_UNAUTHENTICATED_PAYLOAD`` bytes
(the longest AUTH_RESPONSE): a header announcing more is refused as ``oversize`` before a
byte of its payload is read (``decode_header(..., max_payload=...)``). ERROR texts are cut
to ``MAX_ERROR_TEXT_BYTES``.

Encoders return lists of buffers (header + payload parts, memoryviews of chunk
bytes untouched) for ``sendmsg``/``writelines``; decoders validate everything and
raise ``ProtocolError(reason, message)`` with ``reason`` one of
``PROTOCOL_ERROR_REASONS`` (the ``protocol_errors`` metric labels).
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES

# Wire major version carried in every header; a different one is refused.
WIRE_MAJOR = 1
# First two bytes of every frame.
MAGIC = b"KO"
# Header layout: magic, wire major, type, request id, payload length.
HEADER = struct.Struct("!2sBBIQ")
# Bytes of a frame header.
HEADER_BYTES = HEADER.size
# Most keys in one LOOKUP or FETCH.
MAX_KEYS = 65536
# Most keys a key list decoded by one precompiled struct (64 kept, by count and key size) holds.
STRUCT_KEYS_MAX = 256
# Largest payload of any frame other than CHUNK (bytes).
MAX_CONTROL_PAYLOAD = 1 << 20
# Bytes of the server's authentication nonce.
NONCE_BYTES = 16
# Bytes of the HMAC-SHA256 proof.
PROOF_BYTES = 32
# Longest session id in bytes.
MAX_SESSION_ID_BYTES = 256
# Longest UCX worker address accepted in UCX_ATTACH (bytes).
MAX_WORKER_ADDRESS_BYTES = 64 * 1024
# Request ids wrap at 2**32.
REQUEST_ID_MOD = 1 << 32
# Largest payload of any frame before AUTH_OK, either way: the longest AUTH_RESPONSE
# (u16 + a 256-byte session id + 32-byte proof = 290 bytes); AUTH_CHALLENGE and ERROR are shorter.
MAX_UNAUTHENTICATED_PAYLOAD = 2 + MAX_SESSION_ID_BYTES + PROOF_BYTES
# Longest ERROR text (bytes): a reason and one sentence, never a peer's input echoed at length.
MAX_ERROR_TEXT_BYTES = 256

# ProtocolError reasons (the labels of metrics.protocol_errors).
# "timeout": a step before AUTH_OK not done in time; "too_many_connections": refused at accept;
# "rate_limited": a control-port handshake over its source's rate (control/limits.py).
PROTOCOL_ERROR_REASONS = ("malformed", "oversize", "unknown_type", "bad_key", "bad_size",
                          "unauthenticated", "timeout", "too_many_connections", "rate_limited")

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")


class MessageType(enum.IntEnum):
    """Frame types of the data plane."""

    AUTH_CHALLENGE = 1
    AUTH_RESPONSE = 2
    AUTH_OK = 3
    LOOKUP = 4
    LOOKUP_REPLY = 5
    FETCH = 6
    CHUNK = 7
    CHUNK_MISSING = 8
    ERROR = 9
    CLOSE = 10
    UCX_ATTACH = 11
    NIXL_METADATA = 12
    CHUNK_AT = 13
    RELEASE = 14


_TYPES = frozenset(int(t) for t in MessageType)


class ProtocolError(Exception):
    """A frame or payload broke the protocol; ``reason`` is a metrics label."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in PROTOCOL_ERROR_REASONS:
            raise ValueError(f"unknown protocol error reason {reason!r}; "
                             f"use one of {PROTOCOL_ERROR_REASONS}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Header:
    """A decoded, validated frame header."""

    # Message type.
    type: MessageType
    # Request id chosen by the client (u32); replies carry the request's id.
    request_id: int
    # Payload bytes that follow the header.
    length: int


@dataclass(frozen=True)
class ChunkPrefix:
    """The key and checksum at the start of a CHUNK payload."""

    # Chunk key.
    key: bytes
    # XXH3-64 checksum of the chunk bytes as sent by the holder.
    checksum: int
    # Bytes of the prefix on the wire (u16 + key + u64).
    size: int


@dataclass(frozen=True)
class UcxAttach:
    """A UCX client's introduction: its tag base, session and worker address."""

    # Connection id chosen by the client; the high 32 bits of every tag of the connection.
    connection_id: int
    # Session id from the control-plane handshake.
    session_id: bytes
    # HMAC-SHA256(session_key, UCX_ATTACH_CONTEXT || connection id || worker address).
    mac: bytes
    # The client's UCX worker address (opaque bytes).
    worker_address: bytes


# Domain separation of the UCX_ATTACH MAC.
UCX_ATTACH_CONTEXT = b"kv-offload ucx attach"


def ucx_attach_signed_bytes(connection_id: int, worker_address: bytes) -> bytes:
    """The bytes a UCX_ATTACH MAC covers."""
    return UCX_ATTACH_CONTEXT + _U32.pack(connection_id) + worker_address


@dataclass(frozen=True)
class AuthResponse:
    """A client's answer to the server's nonce."""

    # Session id from the control-plane handshake.
    session_id: bytes
    # HMAC-SHA256(session_key, nonce).
    proof: bytes


# ---------------------------------------------------------------- headers


def encode_header(type_: MessageType, request_id: int, length: int) -> bytes:
    """Pack a frame header."""
    return HEADER.pack(MAGIC, WIRE_MAJOR, int(type_), request_id % REQUEST_ID_MOD, length)


def decode_header(buf: bytes | bytearray | memoryview, chunk_bytes: int | None = None, *,
                  max_payload: int = MAX_CONTROL_PAYLOAD) -> Header:
    """Unpack and validate a 16-byte header.

    ``chunk_bytes`` is the negotiated chunk size; when given, a CHUNK header whose
    length cannot hold a prefix plus exactly ``chunk_bytes`` bytes is refused.
    Every other type is limited to ``max_payload`` (``MAX_CONTROL_PAYLOAD``;
    ``MAX_UNAUTHENTICATED_PAYLOAD`` before AUTH_OK), refused as ``oversize`` at the header,
    before a byte of the payload is read or allocated.
    """
    if len(buf) != HEADER_BYTES:
        raise ProtocolError("malformed", f"frame header is {len(buf)} bytes, expected {HEADER_BYTES}")
    magic, major, type_, request_id, length = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError("malformed", f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if major != WIRE_MAJOR:
        raise ProtocolError("malformed", f"wire major version {major} != {WIRE_MAJOR}")
    if type_ not in _TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {type_}")
    mtype = MessageType(type_)
    if mtype is MessageType.CHUNK:
        if chunk_bytes is not None:
            lo = _U16.size + 1 + _U64.size + chunk_bytes
            hi = _U16.size + MAX_KEY_BYTES + _U64.size + chunk_bytes
            if not lo <= length <= hi:
                raise ProtocolError(
                    "bad_size", f"CHUNK payload of {length} bytes cannot hold a "
                    f"{chunk_bytes}-byte chunk (negotiated kv_bytes_per_chunk)")
    elif length > max_payload:
        when = " before authentication" if max_payload < MAX_CONTROL_PAYLOAD else ""
        raise ProtocolError("oversize", f"{mtype.name} payload of {length} bytes exceeds "
                            f"the {max_payload}-byte limit{when}")
    return Header(mtype, request_id, length)


def _frame(type_: MessageType, request_id: int, parts: Sequence[bytes | memoryview]) -> list:
    length = sum(len(p) for p in parts)
    return [encode_header(type_, request_id, length), *parts]


# ---------------------------------------------------------------- keys


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)):
        raise ProtocolError("bad_key", f"chunk key must be bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ProtocolError("bad_key", f"chunk key of {len(key)} bytes; keys take 1..{MAX_KEY_BYTES} bytes")


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """Pack a key list (u32 count + u16-length-prefixed keys)."""
    if len(keys) > MAX_KEYS:
        raise ProtocolError("oversize", f"{len(keys)} keys in one message; at most {MAX_KEYS}")
    sizes = {len(k) for k in keys}
    if len(sizes) == 1 and all(isinstance(k, bytes) for k in keys):  # the usual case: one key size
        (size,) = sizes
        if not 1 <= size <= MAX_KEY_BYTES:
            raise ProtocolError("bad_key", f"chunk key of {size} bytes; keys take 1..{MAX_KEY_BYTES} bytes")
        prefix = _U16.pack(size)
        out = _U32.pack(len(keys)) + prefix + prefix.join(keys)
    else:
        parts = [_U32.pack(len(keys))]
        for key in keys:
            _check_key(key)
            parts += (_U16.pack(len(key)), bytes(key))
        out = b"".join(parts)
    if len(out) > MAX_CONTROL_PAYLOAD:
        raise ProtocolError("oversize", f"key list of {len(out)} bytes exceeds {MAX_CONTROL_PAYLOAD}")
    return out


@functools.lru_cache(maxsize=64)
def _keys_struct(count: int, size: int) -> struct.Struct:
    """The layout of ``count`` keys of ``size`` bytes each (their u16 lengths skipped)."""
    return struct.Struct(f"!{f'{_U16.size}x{size}s' * count}")


def decode_keys(payload: bytes | bytearray | memoryview) -> list[bytes]:
    """Unpack a key list; the payload must be consumed exactly."""
    mv = memoryview(payload)
    if len(mv) < _U32.size:
        raise ProtocolError("malformed", f"key list of {len(mv)} bytes is shorter than its count")
    (count,) = _U32.unpack_from(mv, 0)
    if count > MAX_KEYS:
        raise ProtocolError("oversize", f"{count} keys in one message; at most {MAX_KEYS}")
    pos = _U32.size
    if count and len(mv) >= pos + _U16.size:  # fast path: every key of the first key's size
        (size,) = _U16.unpack_from(mv, pos)
        stride = _U16.size + size
        if 1 <= size <= MAX_KEY_BYTES and len(mv) == pos + count * stride:
            body = bytes(mv[pos:])
            if body[0::stride] == body[0:1] * count and body[1::stride] == body[1:2] * count:
                if count <= STRUCT_KEYS_MAX:  # one C call, no slice per key
                    return list(_keys_struct(count, size).unpack(body))
                return [body[j + _U16.size:j + stride] for j in range(0, count * stride, stride)]
    keys: list[bytes] = []
    for i in range(count):
        if pos + _U16.size > len(mv):
            raise ProtocolError("malformed", f"key list truncated at key {i} of {count}")
        (klen,) = _U16.unpack_from(mv, pos)
        pos += _U16.size
        if not 1 <= klen <= MAX_KEY_BYTES:
            raise ProtocolError("bad_key", f"key {i} is {klen} bytes; keys take 1..{MAX_KEY_BYTES} bytes")
        if pos + klen > len(mv):
            raise ProtocolError("malformed", f"key list truncated inside key {i} of {count}")
        keys.append(bytes(mv[pos:pos + klen]))
        pos += klen
    if pos != len(mv):
        raise ProtocolError("malformed", f"{len(mv) - pos} stray bytes after {count} keys")
    return keys


def _decode_one_key(payload: bytes | bytearray | memoryview, what: str) -> tuple[bytes, int]:
    mv = memoryview(payload)
    if len(mv) < _U16.size:
        raise ProtocolError("malformed", f"{what} of {len(mv)} bytes is shorter than its key length")
    (klen,) = _U16.unpack_from(mv, 0)
    if not 1 <= klen <= MAX_KEY_BYTES:
        raise ProtocolError("bad_key", f"{what} key is {klen} bytes; keys take 1..{MAX_KEY_BYTES} bytes")
    end = _U16.size + klen
    if end > len(mv):
        raise ProtocolError("malformed", f"{what} truncated inside its key")
    return bytes(mv[_U16.size:end]), end


# ---------------------------------------------------------------- encoders


def encode_auth_challenge(nonce: bytes) -> list:
    """Server's nonce."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    return _frame(MessageType.AUTH_CHALLENGE, 0, [nonce])


def encode_auth_response(session_id: bytes, proof: bytes) -> list:
    """Client's session id and HMAC proof."""
    if not 1 <= len(session_id) <= MAX_SESSION_ID_BYTES:
        raise ValueError(f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes, got {len(session_id)}")
    if len(proof) != PROOF_BYTES:
        raise ValueError(f"proof must be {PROOF_BYTES} bytes, got {len(proof)}")
    return _frame(MessageType.AUTH_RESPONSE, 0, [_U16.pack(len(session_id)), session_id, proof])


def encode_auth_ok() -> list:
    """Server accepted the proof."""
    return _frame(MessageType.AUTH_OK, 0, [])


def encode_ucx_attach(connection_id: int, session_id: bytes, mac: bytes, worker_address: bytes) -> list:
    """UCX client's tag base, session, MAC and worker address."""
    if not 1 <= len(session_id) <= MAX_SESSION_ID_BYTES:
        raise ValueError(f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes, got {len(session_id)}")
    if len(mac) != PROOF_BYTES:
        raise ValueError(f"mac must be {PROOF_BYTES} bytes, got {len(mac)}")
    return _frame(MessageType.UCX_ATTACH, 0, [_U32.pack(connection_id), _U16.pack(len(session_id)),
                                              session_id, mac, worker_address])


def encode_lookup(request_id: int, keys: Sequence[bytes]) -> list:
    """Ask how many leading keys the server holds."""
    return _frame(MessageType.LOOKUP, request_id, [encode_keys(keys)])


def lookup_frame(request_id: int, keys: Sequence[bytes]) -> bytes:
    """A whole LOOKUP frame in one buffer, the bytes ``join(encode_lookup(...))`` makes: built
    in a few C calls when every key is ``bytes`` of one allowed size (a lookup's usual keys)."""
    n = len(keys)
    if n and len(set(map(len, keys))) == 1 and type(keys[0]) is bytes:
        size = len(keys[0])
        length = _U32.size + n * (_U16.size + size)
        if 0 < size <= MAX_KEY_BYTES and n <= MAX_KEYS and length <= MAX_CONTROL_PAYLOAD:
            prefix = _U16.pack(size)
            try:
                body = prefix.join(keys)  # another bytes-like key is packed as its bytes, as below
            except TypeError:
                body = b""  # not bytes-like: encode_keys names it
            if len(body) == length - _U32.size - _U16.size:  # every key held len() bytes
                head = HEADER.pack(MAGIC, WIRE_MAJOR, MessageType.LOOKUP, request_id % REQUEST_ID_MOD, length)
                return b"".join((head, _U32.pack(n), prefix, body))
    return join(encode_lookup(request_id, keys))


def encode_lookup_reply(request_id: int, count: int) -> list:
    """Number of leading keys held."""
    return _frame(MessageType.LOOKUP_REPLY, request_id, [_U32.pack(count)])


def encode_fetch(request_id: int, keys: Sequence[bytes]) -> list:
    """Ask for chunks; replies use request ids request_id .. request_id+len(keys)-1."""
    return _frame(MessageType.FETCH, request_id, [encode_keys(keys)])


def encode_chunk_prefix(key: bytes, checksum: int) -> bytes:
    """The key and checksum that start a CHUNK payload."""
    _check_key(key)
    return _U16.pack(len(key)) + key + _U64.pack(checksum)


def encode_chunk(request_id: int, key: bytes, checksum: int, data: memoryview) -> list:
    """CHUNK frame: [header, prefix, data] with ``data`` passed through uncopied."""
    return _frame(MessageType.CHUNK, request_id, [encode_chunk_prefix(key, checksum), data])


def encode_chunk_missing(request_id: int, key: bytes) -> list:
    """The server does not hold ``key``."""
    _check_key(key)
    return _frame(MessageType.CHUNK_MISSING, request_id, [_U16.pack(len(key)) + key])


def encode_error(request_id: int, reason: str, message: str) -> list:
    """An error the peer should log before the connection closes."""
    text = f"{reason}: {message}".encode("utf-8", "replace")[:MAX_ERROR_TEXT_BYTES]
    return _frame(MessageType.ERROR, request_id, [text])


def encode_close() -> list:
    """Orderly goodbye."""
    return _frame(MessageType.CLOSE, 0, [])


def join(parts: Sequence[bytes | memoryview]) -> bytes:
    """Concatenate a small control frame (never used for chunk data)."""
    return b"".join(parts)


# ---------------------------------------------------------------- decoders


def decode_auth_challenge(payload: bytes | bytearray | memoryview) -> bytes:
    """The server's nonce."""
    if len(payload) != NONCE_BYTES:
        raise ProtocolError("malformed", f"AUTH_CHALLENGE of {len(payload)} bytes, expected {NONCE_BYTES}")
    return bytes(payload)


def decode_auth_response(payload: bytes | bytearray | memoryview) -> AuthResponse:
    """The client's session id and proof."""
    mv = memoryview(payload)
    if len(mv) < _U16.size:
        raise ProtocolError("malformed", "AUTH_RESPONSE shorter than its session id length")
    (slen,) = _U16.unpack_from(mv, 0)
    if not 1 <= slen <= MAX_SESSION_ID_BYTES:
        raise ProtocolError("malformed", f"session id of {slen} bytes; expected 1..{MAX_SESSION_ID_BYTES}")
    if len(mv) != _U16.size + slen + PROOF_BYTES:
        raise ProtocolError("malformed", f"AUTH_RESPONSE of {len(mv)} bytes, expected "
                            f"{_U16.size + slen + PROOF_BYTES} for a {slen}-byte session id")
    sid = bytes(mv[_U16.size:_U16.size + slen])
    return AuthResponse(sid, bytes(mv[_U16.size + slen:]))


def decode_auth_ok(payload: bytes | bytearray | memoryview) -> None:
    """AUTH_OK carries nothing."""
    if len(payload):
        raise ProtocolError("malformed", f"AUTH_OK carries {len(payload)} unexpected bytes")


def decode_ucx_attach(payload: bytes | bytearray | memoryview) -> UcxAttach:
    """A UCX client's connection id, session, MAC and worker address."""
    mv = memoryview(payload)
    if len(mv) < _U32.size + _U16.size:
        raise ProtocolError("malformed", f"UCX_ATTACH of {len(mv)} bytes lacks its connection id")
    (cid,) = _U32.unpack_from(mv, 0)
    if cid == 0:
        raise ProtocolError("malformed", "UCX_ATTACH connection id 0 is reserved")
    (slen,) = _U16.unpack_from(mv, _U32.size)
    if not 1 <= slen <= MAX_SESSION_ID_BYTES:
        raise ProtocolError("malformed", f"session id of {slen} bytes; expected 1..{MAX_SESSION_ID_BYTES}")
    pos = _U32.size + _U16.size
    addr_at = pos + slen + PROOF_BYTES
    if addr_at >= len(mv):
        raise ProtocolError("malformed", "UCX_ATTACH lacks its MAC or worker address")
    if len(mv) - addr_at > MAX_WORKER_ADDRESS_BYTES:
        raise ProtocolError("oversize", f"UCX worker address of {len(mv) - addr_at} bytes; "
                            f"at most {MAX_WORKER_ADDRESS_BYTES}")
    return UcxAttach(cid, bytes(mv[pos:pos + slen]), bytes(mv[pos + slen:addr_at]), bytes(mv[addr_at:]))


def decode_lookup_reply(payload: bytes | bytearray | memoryview, asked: int) -> int:
    """The hit prefix length; must not exceed the number of keys asked."""
    if len(payload) != _U32.size:
        raise ProtocolError("malformed", f"LOOKUP_REPLY of {len(payload)} bytes, expected {_U32.size}")
    (count,) = _U32.unpack(payload)
    if count > asked:
        raise ProtocolError("malformed", f"LOOKUP_REPLY claims {count} hits for {asked} keys")
    return count


def decode_chunk_prefix(buf: bytes | bytearray | memoryview) -> ChunkPrefix:
    """Parse the key and checksum at the start of ``buf`` (may hold more bytes)."""
    key, pos = _decode_one_key(buf, "CHUNK")
    mv = memoryview(buf)
    if pos + _U64.size > len(mv):
        raise ProtocolError("malformed", "CHUNK truncated inside its checksum")
    (checksum,) = _U64.unpack_from(mv, pos)
    return ChunkPrefix(key, checksum, pos + _U64.size)


def chunk_prefix_bytes_needed(first_two: bytes | bytearray | memoryview) -> int:
    """Prefix size given its first two bytes (the key length), validating the length."""
    (klen,) = _U16.unpack(first_two)
    if not 1 <= klen <= MAX_KEY_BYTES:
        raise ProtocolError("bad_key", f"CHUNK key is {klen} bytes; keys take 1..{MAX_KEY_BYTES} bytes")
    return _U16.size + klen + _U64.size


def decode_chunk_missing(payload: bytes | bytearray | memoryview) -> bytes:
    """The key the server does not hold."""
    key, pos = _decode_one_key(payload, "CHUNK_MISSING")
    if pos != len(payload):
        raise ProtocolError("malformed", f"{len(payload) - pos} stray bytes after CHUNK_MISSING key")
    return key


def decode_error(payload: bytes | bytearray | memoryview) -> str:
    """The peer's error text."""
    return bytes(payload).decode("utf-8", "replace")


def check_chunk_payload(length: int, prefix_size: int, chunk_bytes: int) -> None:
    """A CHUNK payload must be its prefix plus exactly ``chunk_bytes`` bytes."""
    if length - prefix_size != chunk_bytes:
        raise ProtocolError("bad_size", f"CHUNK carries {length - prefix_size} chunk bytes; "
                            f"the negotiated kv_bytes_per_chunk is {chunk_bytes}")
