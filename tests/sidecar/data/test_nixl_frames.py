"""The NIXL transport's frames, its leases and its install pin, without NIXL agents."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import xxhash
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.nixl import frames
from kv_offload_sidecar.data.nixl.exports import Leases
from kv_offload_sidecar.data.nixl.runtime import NIXL_PACKAGE, PIECE_BYTES, piece_ranges

VIEW = frames.ExportedView(base=0x7F0000000000, slot_stride=2 << 20, slot_bytes=(2 << 20) - 100,
                           num_slots=512, agent="kvo-123-abcd-0", metadata=b"nixlSerDes" + bytes(300))
KEY = b"s" * 32
NONCE = bytes(range(16))


def _payload(frame: list) -> bytes:
    data = proto.join(frame)
    header = proto.decode_header(data[:proto.HEADER_BYTES])
    assert header.length == len(data) - proto.HEADER_BYTES
    return data[proto.HEADER_BYTES:]


def test_metadata_round_trips_only_with_the_session_key_and_the_connections_nonce():
    frame = frames.encode_metadata(VIEW, KEY, NONCE)
    assert proto.decode_header(proto.join(frame)[:proto.HEADER_BYTES]).type is proto.MessageType.NIXL_METADATA
    sealed = _payload(frame)
    assert frames.decode_metadata(sealed, KEY, NONCE) == VIEW
    assert VIEW.metadata not in sealed and VIEW.agent.encode() not in sealed
    for key, nonce in ((b"t" * 32, NONCE), (KEY, bytes(16))):
        with pytest.raises(proto.ProtocolError, match="unauthenticated"):
            frames.decode_metadata(sealed, key, nonce)
    flipped = bytearray(sealed)
    flipped[-1] ^= 1
    with pytest.raises(proto.ProtocolError, match="unauthenticated"):
        frames.decode_metadata(bytes(flipped), KEY, NONCE)
    with pytest.raises(proto.ProtocolError, match="too short"):
        frames.decode_metadata(sealed[:20], KEY, NONCE)


def test_metadata_with_impossible_geometry_is_refused_even_when_sealed_right():
    bad = frames.ExportedView(1, 4096, 8192, 1, "a", b"md")  # a slot longer than its stride
    with pytest.raises(proto.ProtocolError, match="geometry"):
        frames.decode_metadata(_payload(frames.encode_metadata(bad, KEY, NONCE)), KEY, NONCE)


def test_chunk_at_and_release_round_trip_and_refuse_bad_sizes():
    frame = frames.encode_chunk_at(7, b"k" * 36, 2**64 - 1, 511)
    assert frames.decode_chunk_at(_payload(frame)) == (b"k" * 36, 2**64 - 1, 511)
    with pytest.raises(proto.ProtocolError, match="malformed"):
        frames.decode_chunk_at(_payload(frame)[:-1])
    ids = [0, 1, 2**32 - 1]
    assert frames.decode_release(_payload(frames.encode_release(ids))) == ids
    with pytest.raises(proto.ProtocolError, match="2 request ids"):
        frames.decode_release(b"\0\0\0\x02" + b"\0" * 4)
    with pytest.raises(ValueError, match="at most"):
        frames.encode_release(list(range(frames.MAX_RELEASE_IDS + 1)))


def test_pieces_cover_a_chunk_exactly_and_their_streamed_hash_is_the_chunks():
    data = bytes(range(256)) * ((3 * PIECE_BYTES + 123) // 256 + 1)
    data = data[:3 * PIECE_BYTES + 123]
    pieces = piece_ranges(len(data))
    assert pieces[0] == (0, PIECE_BYTES) and pieces[-1] == (3 * PIECE_BYTES, 123)
    assert sum(n for _, n in pieces) == len(data)
    h = xxhash.xxh3_64()
    for off, n in pieces:
        h.update(data[off:off + n])
    assert h.intdigest() == xxhash.xxh3_64_intdigest(data)  # what the store would compute


class _Pin:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_leases_unpin_on_release_on_expiry_and_at_the_end():
    leases = Leases(lease_seconds=10.0)
    pins = [_Pin() for _ in range(4)]
    for rid, pin in enumerate(pins):
        leases.add(rid, pin)
    assert leases.release([1, 99]) == 1 and pins[1].released == 1  # unknown ids are ignored
    assert leases.release([1]) == 0 and pins[1].released == 1  # a second release does nothing
    import time
    assert leases.expire(time.monotonic() + 5) == 0
    assert leases.expire(time.monotonic() + 11) == 3
    assert [p.released for p in pins] == [1, 1, 1, 1]
    again = _Pin()
    leases.add(5, again)
    assert leases.release_all() == 1 and again.released == 1 and len(leases) == 0


def test_the_dev_script_installs_the_nixl_version_the_transport_names():
    dev = (Path(__file__).resolve().parents[3] / "dev").read_text()
    assert re.search(r'^NIXL_PKG="([^"]+)"', dev, re.MULTILINE).group(1) == NIXL_PACKAGE
    assert '--no-deps "$NIXL_PKG"' in dev

