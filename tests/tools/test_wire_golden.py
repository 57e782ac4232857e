"""Golden frames: a wire change under an unchanged WIRE_VERSION fails here.

The record (``tests/tools/wire_golden_frames.json``) holds every message of the data plane,
the handshake, the directory and the shapes of the local channel, built from fixed inputs;
today's encoders must rebuild them byte for byte while ``WIRE_VERSION`` is the recorded one.
A deliberate change bumps ``WIRE_MINOR`` (``peers/wire_window.py``) and re-records
(``wire_golden.RECORD_COMMAND``).
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
from kv_offload_sidecar.data.protocol import MessageType
from kv_offload_sidecar.engine.channel_protocol import OPS
from kv_offload_sidecar.peers.directory import location_wire
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION
from kv_offload_tools import wire_golden

RECORD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                      wire_golden.RECORD_PATH)


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open(RECORD) as fh:
        return json.load(fh)


def changed(recorded: dict, frames: dict[str, str]) -> list[str]:
    """Names of the frames that differ from the record (added and missing ones included)."""
    return sorted(n for n in set(recorded["frames"]) | set(frames)
                  if recorded["frames"].get(n) != frames.get(n))


def verdict(recorded: dict, names: list[str]) -> str:
    if recorded["wire_version"] != WIRE_VERSION:
        return (f"WIRE_VERSION is {WIRE_VERSION}, the golden frames are of {recorded['wire_version']}: "
                f"re-record them: {wire_golden.RECORD_COMMAND}")
    return (f"the wire changed under an unchanged WIRE_VERSION {WIRE_VERSION}: {', '.join(names)}; "
            f"a peer of the last release would misread it. Bump WIRE_MINOR in "
            f"peers/wire_window.py and re-record: {wire_golden.RECORD_COMMAND}")


def test_every_frame_is_rebuilt_byte_for_byte_under_the_recorded_wire_version(recorded):
    names = changed(recorded, wire_golden.frames())
    assert recorded["wire_version"] == WIRE_VERSION and not names, verdict(recorded, names)


def test_the_local_channel_keeps_the_recorded_fields_of_every_op(recorded):
    shapes = wire_golden.channel_shapes()
    names = [op for op in sorted(set(shapes) | set(recorded["channel"]))
             if shapes.get(op) != recorded["channel"].get(op)]
    assert recorded["wire_version"] == WIRE_VERSION and not names, verdict(recorded, names)


def test_the_record_covers_every_message_type_and_every_channel_op(recorded):
    assert {f"data/{t.name}" for t in MessageType} <= set(recorded["frames"])
    assert set(recorded["channel"]) == set(OPS)
    assert all(set(recorded["channel"][op]) == {"request", "reply"} for op in OPS)
    assert {"handshake/step1", "handshake/reply1", "handshake/step2", "handshake/reply2",
            "directory/publish", "directory/publish_reply", "directory/locate",
            "directory/locate_reply"} <= set(recorded["frames"])


def test_a_field_added_to_a_directory_message_is_a_change_that_fails(recorded):
    to_dict = location_wire.PublishReply.to_dict
    with mock.patch.object(location_wire.PublishReply, "to_dict",
                           lambda self: {**to_dict(self), "hint": 1}):
        names = changed(recorded, wire_golden.frames())
    assert names == ["directory/publish_reply"]
    assert "Bump WIRE_MINOR" in verdict(recorded, names)
