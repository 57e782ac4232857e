"""The data-plane frame codec: round trips, and every malformed input refused by reason."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES
from kv_offload_sidecar.metrics import PROTOCOL_ERROR_REASONS

CHUNK = 4096


def _join(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _split(frame: bytes, chunk_bytes: int | None = None) -> tuple[proto.Header, bytes]:
    header = proto.decode_header(frame[:proto.HEADER_BYTES], chunk_bytes)
    payload = frame[proto.HEADER_BYTES:]
    assert len(payload) == header.length
    return header, payload


def test_reasons_are_the_metric_labels() -> None:
    assert proto.PROTOCOL_ERROR_REASONS == PROTOCOL_ERROR_REASONS


def test_header_layout_is_magic_version_type_request_length() -> None:
    raw = proto.encode_header(proto.MessageType.FETCH, 7, 99)
    assert struct.unpack("!2sBBIQ", raw) == (b"KO", 1, proto.MessageType.FETCH, 7, 99)


@given(st.lists(st.binary(min_size=1, max_size=64), max_size=40), st.integers(0, 2**32 - 1))
def test_key_lists_round_trip(keys: list[bytes], rid: int) -> None:
    header, payload = _split(_join(proto.encode_lookup(rid, keys)))
    assert header.type is proto.MessageType.LOOKUP and header.request_id == rid
    assert proto.decode_keys(payload) == keys


@given(st.lists(st.binary(min_size=1, max_size=40), max_size=40), st.integers(0, 2**32 - 1))
def test_a_lookup_frame_in_one_buffer_is_the_bytes_of_the_joined_encoder(keys: list[bytes], rid: int) -> None:
    assert proto.lookup_frame(rid, keys) == _join(proto.encode_lookup(rid, keys))


@pytest.mark.parametrize("count", [1, 32, proto.STRUCT_KEYS_MAX, proto.STRUCT_KEYS_MAX + 1, 3000])
def test_key_lists_of_one_key_size_round_trip_through_one_struct_or_key_by_key(count: int) -> None:
    keys = [i.to_bytes(36, "big") for i in range(count)]
    assert proto.decode_keys(bytearray(proto.encode_keys(keys))) == keys
    assert proto.lookup_frame(5, keys) == _join(proto.encode_lookup(5, keys))


def test_a_lookup_frame_refuses_what_the_encoder_refuses() -> None:
    for keys, reason in (([b""] * 3, "bad_key"), ([b"k"] * (proto.MAX_KEYS + 1), "oversize"),
                         ([b"k" * (MAX_KEY_BYTES + 1)], "bad_key")):
        with pytest.raises(proto.ProtocolError) as err:
            proto.lookup_frame(1, keys)
        assert err.value.reason == reason
    with pytest.raises(proto.ProtocolError) as err:
        proto.lookup_frame(1, [b"ab", "cd"])  # type: ignore[list-item]
    assert err.value.reason == "bad_key"


def test_chunk_frame_passes_the_slot_view_through_uncopied() -> None:
    data = bytearray(b"x" * CHUNK)
    view = memoryview(data)
    parts = proto.encode_chunk(5, b"key-1", 0xDEADBEEF, view)
    assert parts[-1] is view  # the big payload is never concatenated
    header, payload = _split(_join(parts), CHUNK)
    prefix = proto.decode_chunk_prefix(payload)
    assert (prefix.key, prefix.checksum) == (b"key-1", 0xDEADBEEF)
    assert payload[prefix.size:] == bytes(data)
    proto.check_chunk_payload(header.length, prefix.size, CHUNK)


def test_chunk_of_another_size_than_negotiated_is_bad_size() -> None:
    far_off = _join(proto.encode_chunk(1, b"k", 1, memoryview(bytes(2 * CHUNK))))
    with pytest.raises(proto.ProtocolError) as err:  # refused from the header alone
        proto.decode_header(far_off[:proto.HEADER_BYTES], CHUNK)
    assert err.value.reason == "bad_size"
    assert "kv_bytes_per_chunk" in str(err.value)
    one_off = _join(proto.encode_chunk(1, b"k", 1, memoryview(bytes(CHUNK + 1))))
    header = proto.decode_header(one_off[:proto.HEADER_BYTES], CHUNK)
    prefix = proto.decode_chunk_prefix(one_off[proto.HEADER_BYTES:])
    with pytest.raises(proto.ProtocolError) as err:  # refused once the prefix is known
        proto.check_chunk_payload(header.length, prefix.size, CHUNK)
    assert err.value.reason == "bad_size"


def test_auth_frames_round_trip() -> None:
    nonce = bytes(range(16))
    _, payload = _split(_join(proto.encode_auth_challenge(nonce)))
    assert proto.decode_auth_challenge(payload) == nonce
    _, payload = _split(_join(proto.encode_auth_response(b"sid", b"p" * 32)))
    assert proto.decode_auth_response(payload) == proto.AuthResponse(b"sid", b"p" * 32)
    attach = proto.encode_ucx_attach(9, b"sid", b"m" * 32, b"worker-address")
    _, payload = _split(_join(attach))
    decoded = proto.decode_ucx_attach(payload)
    assert (decoded.connection_id, decoded.session_id, decoded.mac, decoded.worker_address) == (
        9, b"sid", b"m" * 32, b"worker-address")


def test_replies_round_trip() -> None:
    _, payload = _split(_join(proto.encode_lookup_reply(3, 12)))
    assert proto.decode_lookup_reply(payload, asked=32) == 12
    _, payload = _split(_join(proto.encode_chunk_missing(3, b"gone")))
    assert proto.decode_chunk_missing(payload) == b"gone"
    _, payload = _split(_join(proto.encode_error(3, "bad_key", "key 0 is empty")))
    assert proto.decode_error(payload) == "bad_key: key 0 is empty"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"XX" + proto.encode_header(proto.MessageType.CLOSE, 0, 0)[2:], "malformed"),
        (struct.pack("!2sBBIQ", b"KO", 2, 10, 0, 0), "malformed"),
        (struct.pack("!2sBBIQ", b"KO", 1, 99, 0, 0), "unknown_type"),
        (struct.pack("!2sBBIQ", b"KO", 1, proto.MessageType.LOOKUP, 0, 2**40), "oversize"),
        (b"KO\x01", "malformed"),
    ],
    ids=["bad-magic", "other-wire-major", "unknown-type", "oversized-length", "truncated-header"],
)
def test_bad_headers_are_refused_by_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(proto.ProtocolError) as err:
        proto.decode_header(raw, CHUNK)
    assert err.value.reason == reason


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00\x00", "malformed"),  # shorter than the count
        (struct.pack("!I", proto.MAX_KEYS + 1), "oversize"),
        (struct.pack("!IH", 1, 0), "bad_key"),  # empty key
        (struct.pack("!IH", 1, proto.MAX_KEY_BYTES + 1), "bad_key"),
        (struct.pack("!IH", 1, 5) + b"abc", "malformed"),  # truncated inside the key
        (struct.pack("!IH", 2, 1) + b"a", "malformed"),  # fewer keys than counted
        (struct.pack("!IH", 1, 1) + b"ab", "malformed"),  # stray bytes
    ],
    ids=["short", "too-many-keys", "empty-key", "long-key", "truncated-key", "missing-key", "stray"],
)
def test_bad_key_lists_are_refused_by_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(proto.ProtocolError) as err:
        proto.decode_keys(payload)
    assert err.value.reason == reason


def test_lookup_reply_claiming_more_hits_than_asked_is_malformed() -> None:
    with pytest.raises(proto.ProtocolError, match="claims 5 hits for 4 keys"):
        proto.decode_lookup_reply(struct.pack("!I", 5), asked=4)


def test_auth_response_with_wrong_length_is_malformed() -> None:
    with pytest.raises(proto.ProtocolError) as err:
        proto.decode_auth_response(struct.pack("!H", 3) + b"sid" + b"short-proof")
    assert err.value.reason == "malformed"


def test_ucx_attach_with_reserved_connection_id_is_malformed() -> None:
    _, payload = _split(_join(proto.encode_ucx_attach(0, b"s", b"m" * 32, b"addr")))
    with pytest.raises(proto.ProtocolError, match="reserved"):
        proto.decode_ucx_attach(payload)


def test_encoders_refuse_keys_the_decoder_would_refuse() -> None:
    with pytest.raises(proto.ProtocolError) as err:
        proto.encode_fetch(1, [b""])
    assert err.value.reason == "bad_key"
    with pytest.raises(proto.ProtocolError) as err:
        proto.encode_lookup(1, [b"k"] * (proto.MAX_KEYS + 1))
    assert err.value.reason == "oversize"


@given(st.binary(max_size=64))
def test_decoders_never_fail_other_than_with_protocol_error(junk: bytes) -> None:
    for decode in (proto.decode_keys, proto.decode_chunk_missing, proto.decode_auth_response,
                   proto.decode_ucx_attach, proto.decode_chunk_prefix, proto.decode_auth_challenge):
        try:
            decode(junk)
        except proto.ProtocolError as exc:
            assert exc.reason in proto.PROTOCOL_ERROR_REASONS
    try:
        proto.decode_header(junk[:proto.HEADER_BYTES], CHUNK)
    except proto.ProtocolError as exc:
        assert exc.reason in proto.PROTOCOL_ERROR_REASONS


def test_before_the_proof_a_header_announcing_more_than_the_longest_auth_response_is_oversize() -> None:
    limit = proto.MAX_UNAUTHENTICATED_PAYLOAD
    longest = proto.encode_auth_response(b"s" * proto.MAX_SESSION_ID_BYTES, bytes(proto.PROOF_BYTES))
    header = proto.decode_header(longest[0], max_payload=limit)
    assert header.length == limit == 290
    with pytest.raises(proto.ProtocolError) as err:
        proto.decode_header(proto.encode_header(proto.MessageType.AUTH_RESPONSE, 0, limit + 1),
                            max_payload=limit)
    assert err.value.reason == "oversize" and "before authentication" in str(err.value)
    # after the proof the control-frame limit applies as before
    assert proto.decode_header(proto.encode_header(proto.MessageType.LOOKUP, 0, 1 << 20)).length == 1 << 20


def test_error_texts_are_cut_to_a_sentence_that_fits_the_unauthenticated_limit() -> None:
    frame = proto.join(proto.encode_error(0, "malformed", "x" * 100_000))
    header, payload = _split(frame)
    assert header.length == proto.MAX_ERROR_TEXT_BYTES <= proto.MAX_UNAUTHENTICATED_PAYLOAD
    assert proto.decode_error(payload).startswith("malformed: xxx")


@given(st.binary(min_size=proto.HEADER_BYTES, max_size=proto.HEADER_BYTES))
def test_any_header_before_the_proof_is_either_small_or_a_protocol_error(raw: bytes) -> None:
    try:
        header = proto.decode_header(raw, None, max_payload=proto.MAX_UNAUTHENTICATED_PAYLOAD)
    except proto.ProtocolError as exc:
        assert exc.reason in proto.PROTOCOL_ERROR_REASONS
    else:
        assert header.type is proto.MessageType.CHUNK or header.length <= proto.MAX_UNAUTHENTICATED_PAYLOAD
