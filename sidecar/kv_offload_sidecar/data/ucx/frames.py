"""The UCX data plane's wire layout: tags, worker addresses, the attach MAC and frame parsing.

Tags (64 bits): the high 32 bits are the connection id the client picked, the
low 32 bits say what travels: ``TAG_C2S`` client->server frames, ``TAG_S2C``
server->client frames, ``TAG_DATA | request id`` the bytes of one chunk.
``ATTACH_TAG`` is the server's attach tag. UCX matches tags per worker, not
per endpoint, so the connection id is how the server tells its clients apart;
it is used only after the client proved its session (the attach MAC, then
the nonce challenge). A FETCH's replies travel as one message of CHUNK /
CHUNK_MISSING frames back to back (``pack_frames`` / ``split_frames``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging

from kv_offload_sidecar.data import protocol as proto

log = logging.getLogger(__name__)

# Tag of UCX_ATTACH messages ("KO" .. "ATTC"); its low half is no connection's tag kind.
ATTACH_TAG = 0x4B4F_0000_4154_5443

# Low tag bits: client -> server frames.
TAG_C2S = 0

# Low tag bits: server -> client frames.
TAG_S2C = 1

# Low tag bit marking a chunk's bytes; the other 31 bits are its request id.
TAG_DATA = 0x8000_0000

# Request ids of UCX clients wrap at 2**31 (they are part of a data tag).
UCX_REQUEST_ID_MOD = 1 << 31

# Receive buffer of one control frame (header + the largest control payload).
CONTROL_BUFFER_BYTES = proto.HEADER_BYTES + proto.MAX_CONTROL_PAYLOAD

# Receive buffer of a frame before AUTH_OK (the challenge, the proof, AUTH_OK or an ERROR).
UNAUTHENTICATED_BUFFER_BYTES = proto.HEADER_BYTES + proto.MAX_UNAUTHENTICATED_PAYLOAD

# Receive buffer of UCX_ATTACH messages (one at a time: the server checks them in turn).
ATTACH_BUFFER_BYTES = (proto.HEADER_BYTES + 4 + 2 + proto.MAX_SESSION_ID_BYTES + proto.PROOF_BYTES
                       + proto.MAX_WORKER_ADDRESS_BYTES)


def tag(connection_id: int, low: int) -> int:
    return (connection_id << 32) | low


def data_tag(connection_id: int, request_id: int) -> int:
    return tag(connection_id, TAG_DATA | (request_id % UCX_REQUEST_ID_MOD))


def join_parts(parts: list) -> bytearray:
    """A control frame as one contiguous message."""
    return bytearray(proto.join(parts))


def encode_address(worker_address: bytes) -> str:
    """``ucx://<base64 worker address>``."""
    return "ucx://" + base64.urlsafe_b64encode(worker_address).decode("ascii")


def decode_address(address: str) -> bytes:
    """The worker address inside ``ucx://...``; ValueError when it is not one."""
    rest = address.removeprefix("ucx://")
    try:
        raw = base64.urlsafe_b64decode(rest.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"UCX data address {address[:40]!r}... is not ucx://<base64>") from exc
    if not raw or len(raw) > proto.MAX_WORKER_ADDRESS_BYTES:
        raise ValueError(f"UCX data address carries {len(raw)} bytes; expected a worker address")
    return raw


def attach_mac(session_key: bytes, connection_id: int, worker_address: bytes) -> bytes:
    """MAC of a UCX_ATTACH message."""
    return hmac.new(session_key, proto.ucx_attach_signed_bytes(connection_id, worker_address),
                    hashlib.sha256).digest()


def parse_frame(buf: bytearray, chunk_bytes: int | None) -> tuple[proto.Header, memoryview]:
    """Validate one received message: header, then a payload of exactly the announced size.

    A CHUNK message carries only the prefix (key + checksum); its header's length
    still counts the chunk bytes, which follow as their own message.
    """
    if len(buf) < proto.HEADER_BYTES:
        raise proto.ProtocolError("malformed", f"message of {len(buf)} bytes is shorter than a header")
    header = proto.decode_header(memoryview(buf)[:proto.HEADER_BYTES], chunk_bytes)
    payload = memoryview(buf)[proto.HEADER_BYTES:]
    if header.type is proto.MessageType.CHUNK:
        prefix = proto.decode_chunk_prefix(payload)
        if prefix.size != len(payload):
            raise proto.ProtocolError("malformed", f"CHUNK message carries {len(payload)} bytes "
                                      f"after its header, its prefix is {prefix.size}")
    elif len(payload) != header.length:
        raise proto.ProtocolError("malformed", f"{header.type.name} message carries {len(payload)} "
                                  f"payload bytes, its header says {header.length}")
    return header, payload


def split_frames(buf: bytearray) -> list[tuple[proto.Header, memoryview]]:
    """The frames of one server->client message, back to back (a batch of CHUNK and
    CHUNK_MISSING frames answering a FETCH, or one frame). A CHUNK frame carries its
    prefix only (its bytes follow on their own tag); any other frame exactly the
    payload its header announces. A frame cut short is refused as malformed."""
    mv = memoryview(buf)
    if len(mv) < proto.HEADER_BYTES:
        raise proto.ProtocolError("malformed", f"message of {len(mv)} bytes is shorter than a header")
    frames = []
    pos = 0
    while pos < len(mv):
        if len(mv) - pos < proto.HEADER_BYTES:
            raise proto.ProtocolError("malformed", f"{len(mv) - pos} bytes after the last frame of a "
                                      "message are shorter than a header")
        header = proto.decode_header(mv[pos:pos + proto.HEADER_BYTES], None)
        body = mv[pos + proto.HEADER_BYTES:]
        if header.type is proto.MessageType.CHUNK:
            size = proto.decode_chunk_prefix(body).size
        else:
            size = header.length
            if size > len(body):
                raise proto.ProtocolError("malformed", f"{header.type.name} frame announces {size} "
                                          f"payload bytes, the message holds {len(body)}")
        frames.append((header, body[:size]))
        pos += proto.HEADER_BYTES + size
    return frames


def pack_frames(frames: list[bytes], limit: int) -> list[bytearray]:
    """Frames joined into as few messages of at most ``limit`` bytes as they fit."""
    messages: list[bytearray] = []
    current = bytearray()
    for frame in frames:
        if current and len(current) + len(frame) > limit:
            messages.append(current)
            current = bytearray()
        current += frame
    if current:
        messages.append(current)
    return messages


CHUNK_REPLIES = (proto.MessageType.CHUNK, proto.MessageType.CHUNK_MISSING)
