"""The NIXL transport's frames (types in ``data.protocol``) and its sealed metadata.

- ``NIXL_METADATA`` server -> client, right after AUTH_OK: 12-byte nonce + AES-256-GCM
  ciphertext (key = HMAC-SHA256(session_key, ``METADATA_KEY_LABEL``), associated data =
  ``METADATA_AAD`` + the connection's 16-byte auth nonce) of the ``ExportedView``: u64 base
  address, u64 slot stride, u64 slot bytes, u32 slot count, u16 length + the holder agent's
  name, then the holder's partial NIXL agent metadata (the connection info and the remote
  key of this connection's registration only). Only a client that knows the session key can
  read it, and it is bound to this one connection.
- ``CHUNK_AT`` server -> client, one per FETCH key (instead of CHUNK): u16 length + key,
  u64 checksum, u32 slot. The chunk stays pinned until the client RELEASEs its request id
  or the server's lease runs out.
- ``RELEASE`` client -> server: u32 count + count x u32 request ids the client has read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES

# Derives the metadata sealing key from the session key.
METADATA_KEY_LABEL = b"kv-offload nixl metadata key v1"
# Associated data of the sealed metadata (followed by the connection's auth nonce).
METADATA_AAD = b"kv-offload nixl metadata v1\x00"
# Bytes of the AES-GCM nonce.
SEAL_NONCE_BYTES = 12
# Longest holder agent name (bytes).
MAX_AGENT_NAME_BYTES = 256
# Most request ids one RELEASE carries.
MAX_RELEASE_IDS = (proto.MAX_CONTROL_PAYLOAD - 4) // 4

_VIEW = struct.Struct("!QQQIH")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")


@dataclass(frozen=True)
class ExportedView:
    """What a fetcher learns of one connection's view of the holder's store."""

    # Holder address of slot 0 in this connection's view.
    base: int
    # Bytes between slot starts.
    slot_stride: int
    # Bytes of one chunk.
    slot_bytes: int
    # Slots in the view.
    num_slots: int
    # The holder's NIXL agent name.
    agent: str
    # The holder's partial NIXL agent metadata (this view's registration, connection info).
    metadata: bytes


def _aead(session_key: bytes):  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hmac.new(session_key, METADATA_KEY_LABEL, hashlib.sha256).digest())


def encode_metadata(view: ExportedView, session_key: bytes, auth_nonce: bytes) -> list:
    """The NIXL_METADATA frame: ``view`` sealed under the session key, bound to ``auth_nonce``."""
    name = view.agent.encode()
    if not 1 <= len(name) <= MAX_AGENT_NAME_BYTES:
        raise ValueError(f"NIXL agent name of {len(name)} bytes; expected 1..{MAX_AGENT_NAME_BYTES}")
    plain = _VIEW.pack(view.base, view.slot_stride, view.slot_bytes, view.num_slots, len(name)) + name
    nonce = os.urandom(SEAL_NONCE_BYTES)
    sealed = nonce + _aead(session_key).encrypt(nonce, plain + view.metadata, METADATA_AAD + auth_nonce)
    return [proto.encode_header(proto.MessageType.NIXL_METADATA, 0, len(sealed)), sealed]


def decode_metadata(payload: bytes | bytearray | memoryview, session_key: bytes,
                    auth_nonce: bytes) -> ExportedView:
    """Open a NIXL_METADATA payload; ProtocolError('unauthenticated') when it was not sealed
    for this session and connection, 'malformed' when its contents do not parse."""
    from cryptography.exceptions import InvalidTag

    data = bytes(payload)
    if len(data) <= SEAL_NONCE_BYTES + 16:
        raise proto.ProtocolError("malformed", f"NIXL_METADATA of {len(data)} bytes is too short")
    try:
        plain = _aead(session_key).decrypt(data[:SEAL_NONCE_BYTES], data[SEAL_NONCE_BYTES:],
                                           METADATA_AAD + auth_nonce)
    except InvalidTag:
        raise proto.ProtocolError("unauthenticated", "NIXL_METADATA is not sealed for this session "
                                  "and connection") from None
    if len(plain) < _VIEW.size:
        raise proto.ProtocolError("malformed", "NIXL_METADATA lacks its view geometry")
    base, stride, slot_bytes, num_slots, name_len = _VIEW.unpack_from(plain)
    end = _VIEW.size + name_len
    if not 1 <= name_len <= MAX_AGENT_NAME_BYTES or end >= len(plain):
        raise proto.ProtocolError("malformed", "NIXL_METADATA agent name or metadata is missing")
    if not 0 < slot_bytes <= stride or num_slots == 0:
        raise proto.ProtocolError("malformed", f"NIXL_METADATA geometry: {num_slots} slots of "
                                  f"{slot_bytes} bytes every {stride} bytes")
    try:
        agent = plain[_VIEW.size:end].decode()
    except UnicodeDecodeError:
        raise proto.ProtocolError("malformed", "NIXL_METADATA agent name is not UTF-8") from None
    return ExportedView(base, stride, slot_bytes, num_slots, agent, plain[end:])


def encode_chunk_at(request_id: int, key: bytes, checksum: int, slot: int) -> list:
    """CHUNK_AT: ``key`` (``checksum``) is pinned in ``slot`` of the connection's view."""
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise proto.ProtocolError("bad_key", f"chunk key of {len(key)} bytes")
    body = _U16.pack(len(key)) + key + _U64.pack(checksum) + _U32.pack(slot)
    return [proto.encode_header(proto.MessageType.CHUNK_AT, request_id, len(body)), body]


def decode_chunk_at(payload: bytes | bytearray | memoryview) -> tuple[bytes, int, int]:
    """``(key, checksum, slot)`` of a CHUNK_AT payload."""
    mv = memoryview(payload)
    if len(mv) < _U16.size:
        raise proto.ProtocolError("malformed", "CHUNK_AT shorter than its key length")
    (klen,) = _U16.unpack_from(mv, 0)
    if not 1 <= klen <= MAX_KEY_BYTES:
        raise proto.ProtocolError("bad_key", f"CHUNK_AT key is {klen} bytes")
    if len(mv) != _U16.size + klen + _U64.size + _U32.size:
        raise proto.ProtocolError("malformed", f"CHUNK_AT of {len(mv)} bytes for a {klen}-byte key")
    key = bytes(mv[_U16.size:_U16.size + klen])
    (checksum,) = _U64.unpack_from(mv, _U16.size + klen)
    (slot,) = _U32.unpack_from(mv, _U16.size + klen + _U64.size)
    return key, checksum, slot


def encode_release(request_ids: Sequence[int]) -> list:
    """RELEASE of ``request_ids`` (at most ``MAX_RELEASE_IDS``)."""
    if len(request_ids) > MAX_RELEASE_IDS:
        raise ValueError(f"{len(request_ids)} request ids in one RELEASE; at most {MAX_RELEASE_IDS}")
    body = _U32.pack(len(request_ids)) + b"".join(_U32.pack(r % proto.REQUEST_ID_MOD) for r in request_ids)
    return [proto.encode_header(proto.MessageType.RELEASE, 0, len(body)), body]


def decode_release(payload: bytes | bytearray | memoryview) -> list[int]:
    """The request ids of a RELEASE payload."""
    mv = memoryview(payload)
    if len(mv) < _U32.size:
        raise proto.ProtocolError("malformed", "RELEASE shorter than its count")
    (count,) = _U32.unpack_from(mv, 0)
    if len(mv) != _U32.size * (count + 1):
        raise proto.ProtocolError("malformed", f"RELEASE of {len(mv)} bytes for {count} request ids")
    return [v for (v,) in _U32.iter_unpack(mv[_U32.size:])]
