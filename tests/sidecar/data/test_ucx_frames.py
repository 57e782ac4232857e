"""How UCX server->client messages carry frames: a FETCH's replies packed into few
messages and split back exactly, anything cut short refused (no UCX needed)."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.ucx.frames import pack_frames, split_frames


def _chunk_frame(request_id: int, key: bytes, checksum: int, chunk_bytes: int) -> bytes:
    prefix = proto.encode_chunk_prefix(key, checksum)
    return proto.encode_header(proto.MessageType.CHUNK, request_id, len(prefix) + chunk_bytes) + prefix


def _replies(n: int) -> list[bytes]:
    frames = []
    for i in range(n):
        key = f"key-{i}".encode()
        if i % 4 == 3:
            frames.append(proto.join(proto.encode_chunk_missing(100 + i, key)))
        else:
            frames.append(_chunk_frame(100 + i, key, 2**64 - 1 - i, 1 << 20))
    return frames


def test_packed_replies_split_back_into_the_same_frames_in_order() -> None:
    frames = _replies(10)
    (message,) = pack_frames(frames, 1 << 20)
    parsed = split_frames(message)
    assert [h.request_id for h, _ in parsed] == list(range(100, 110))
    for i, (header, payload) in enumerate(parsed):
        if i % 4 == 3:
            assert header.type is proto.MessageType.CHUNK_MISSING
            assert proto.decode_chunk_missing(payload) == f"key-{i}".encode()
        else:
            prefix = proto.decode_chunk_prefix(payload)
            assert header.type is proto.MessageType.CHUNK and prefix.size == len(payload)
            assert (prefix.key, prefix.checksum) == (f"key-{i}".encode(), 2**64 - 1 - i)


def test_replies_over_the_limit_go_in_several_messages_none_longer_than_the_limit() -> None:
    frames = _replies(40)
    limit = 5 * max(len(f) for f in frames)
    messages = pack_frames(frames, limit)
    assert len(messages) >= 8 and all(len(m) <= limit for m in messages)
    parsed = [h.request_id for m in messages for h, _ in split_frames(m)]
    assert parsed == list(range(100, 140))


def test_a_frame_cut_short_is_refused_as_malformed() -> None:
    frames = _replies(4)
    message = bytearray(b"".join(frames))
    with pytest.raises(proto.ProtocolError, match="malformed"):
        split_frames(message[:-3])  # the CHUNK_MISSING frame lost its last key bytes
    with pytest.raises(proto.ProtocolError, match="shorter than a header"):
        split_frames(message + bytearray(5))  # trailing bytes after the last frame
    with pytest.raises(proto.ProtocolError, match="malformed"):
        split_frames(bytearray(message[:len(frames[0]) - 2]))  # a CHUNK prefix cut short
    with pytest.raises(proto.ProtocolError, match="shorter than a header"):
        split_frames(bytearray())


def test_a_frame_of_another_wire_version_is_refused() -> None:
    frame = bytearray(_replies(1)[0])
    frame[2] = proto.WIRE_MAJOR + 1
    with pytest.raises(proto.ProtocolError, match="wire major version"):
        split_frames(frame)
