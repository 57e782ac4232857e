"""The local channel between the tier inside vLLM and its pod's sidecar, defined once for both sides.

A Unix socket per DP port. Frames are a 4-byte big-endian length and a UTF-8
JSON object (at most ``MAX_FRAME_BYTES``). Requests carry ``"op"`` (one of
``OPS``); every reply has ``"ok"`` and, when false, ``"error"`` (and
``"stale": true`` when the request named a sidecar instance that is gone).
Chunk keys travel as hex strings. Chunk bytes never cross the socket: the
sidecar maps vLLM's primary region (``attach_region``, whose frame carries the
region file's descriptor) and copies between its rows and the store's slots
(``store_rows`` / ``load_rows``); where the region cannot be shared, the engine
maps the store file and copies into or out of the slots a reply names.
Bodies are parsed with ``bounded_json.loads_bounded`` (bounded depth and
number size) on both sides.

A ``load_rows`` answer is sent only once no byte of the job lands in vLLM's rows any
more (the receive into an offered row stopped, the copy thread done), and it is always
sent, on the connection that asked, however late: a sidecar answers each connection's
requests in order. So an engine that gave up waiting (a stalled sidecar, past the
deadline plus ``ROW_COPY_GRACE_SECONDS``) keeps that connection and reads the late
answer, or its end (the sidecar is gone), as the notice that the rows are its own
again (vLLM 0.34's deferred release: ``engine.tier_releases``). No field was added for it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from kv_offload_sidecar.engine.bounded_json import loads_bounded
from kv_offload_sidecar.engine.keys import MAX_KEY_BYTES

LENGTH = struct.Struct("!I")
# Largest frame either way (bytes).
MAX_FRAME_BYTES = 16 << 20
# Most keys in one request.
MAX_KEYS = 65536
# Longest accepted timeout (seconds).
MAX_TIMEOUT_SECONDS = 600.0
OPS = ("info", "lookup", "reserve", "commit", "abort", "load", "release", "attach_region",
       "store_rows", "load_rows", "cancel")


def encode_frame(obj: Mapping[str, Any]) -> bytes:
    """One frame: length prefix and compact JSON."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return LENGTH.pack(len(data)) + data


def frame_length(head: bytes) -> int:
    """The body length a 4-byte frame head announces; ValueError past ``MAX_FRAME_BYTES``."""
    (n,) = LENGTH.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return n


def decode_body(body: bytes) -> Any:
    """The JSON value of a frame body; ValueError naming what is wrong."""
    try:
        return loads_bounded(body)
    except ValueError as exc:
        raise ValueError(f"frame is not JSON within bounds: {exc}") from None


def encode_keys(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def decode_keys(value: Any) -> list[bytes]:
    """Keys of a request; ValueError naming the bad one (and whether it was too many)."""
    if not isinstance(value, list):
        raise ValueError("'keys' must be a list of hex strings")
    if len(value) > MAX_KEYS:
        raise OverflowError(f"'keys' holds {len(value)} keys; at most {MAX_KEYS}")
    out = []
    for i, item in enumerate(value):
        try:
            key = bytes.fromhex(item) if isinstance(item, str) else b""
        except ValueError:
            key = b""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise KeyError(f"keys[{i}] must be hex of 1..{MAX_KEY_BYTES} bytes")
        out.append(key)
    return out
