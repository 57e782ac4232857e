"""The local channel's framing and key encoding, shared by the engine's client and the sidecar."""

import pytest
from kv_offload_sidecar.engine import channel_protocol as cp


def test_a_frame_round_trips_through_its_length_head_and_json_body():
    frame = cp.encode_frame({"op": "lookup", "keys": cp.encode_keys([b"\x01" * 36])})
    n = cp.frame_length(frame[:cp.LENGTH.size])
    assert n == len(frame) - cp.LENGTH.size
    body = cp.decode_body(frame[cp.LENGTH.size:])
    assert body["op"] == "lookup" and cp.decode_keys(body["keys"]) == [b"\x01" * 36]


def test_an_oversized_frame_head_and_a_non_json_body_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="exceeds"):
        cp.frame_length(cp.LENGTH.pack(cp.MAX_FRAME_BYTES + 1))
    with pytest.raises(ValueError, match="not JSON"):
        cp.decode_body(b"\xff{")


def test_bad_keys_are_refused_naming_the_key_and_too_many_keys_are_refused_as_oversize():
    with pytest.raises(KeyError, match=r"keys\[1\]"):
        cp.decode_keys(["01", "zz"])
    with pytest.raises(KeyError, match=r"keys\[0\]"):
        cp.decode_keys(["00" * (4096 + 1)])
    with pytest.raises(OverflowError):
        cp.decode_keys(["01"] * (cp.MAX_KEYS + 1))
    with pytest.raises(ValueError, match="list of hex"):
        cp.decode_keys("01")
