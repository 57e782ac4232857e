"""Golden frames: every message of every wire, built from fixed inputs, to compare with a record.

What a release says to another release, or to an engine's tier of another release, is pinned
by ``tests/tools/wire_golden_frames.json``: ``frames`` (hex) of every data-plane message type
(``data/protocol.py``, the UCX attach MAC, the NIXL frames with a fixed seal nonce), the
handshake's steps and hellos (fixed nonces, key and hash seed; ``peers/handshake.py``), the
session derivation and the directory messages with their authentication
(``peers/directory/location_wire.py``); and ``channel``, the shape (field names and value
types) of every request and reply of the local channel (``engine/channel_protocol.py``), as
this tree's ``EngineClient`` and sidecar exchange them (a one-sidecar ``LocalPool``, a memfd
row region). ``wire_version`` is the ``WIRE_VERSION`` they were recorded under.

A frame that differs under an unchanged ``WIRE_VERSION`` fails
``tests/tools/test_wire_golden.py``. A deliberate change bumps ``WIRE_MINOR``
(``peers/wire_window.py``) and re-records::

    PYTHONPATH=sidecar:operator .venv/bin/python -m kv_offload_tools.wire_golden --write
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.data.nixl import frames as nixl_frames
from kv_offload_sidecar.data.ucx.frames import attach_mac
from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.peers import handshake as hs
from kv_offload_sidecar.peers.directory import location_wire as lw
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION
from kv_offload_sidecar.store.checksum import chunk_checksum

from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY

# Where the record lives, from the repository root.
RECORD_PATH = os.path.join("tests", "tools", "wire_golden_frames.json")
# The command that re-records it (docs/how-to/upgrade.md, "Upgrades").
RECORD_COMMAND = "PYTHONPATH=sidecar:operator .venv/bin/python -m kv_offload_tools.wire_golden --write"

_KEY = b"golden-pool-key-0123456789abcdef"
_NONCE_C, _NONCE_S = bytes(range(16)), bytes(range(16, 32))
_CHUNK_KEY = bytes(range(32)) + b"\0\0\0\1"
_CHUNK = bytes(i % 251 for i in range(4096))


def _hex(parts: list | bytes) -> str:
    return (parts if isinstance(parts, bytes) else proto.join(parts)).hex()


def _json(body: Any) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode().hex()


def data_frames() -> dict[str, str]:
    """One frame of every data-plane message type, and the MACs its frames carry."""
    session_id, session_key = hs.derive_session(_KEY, _NONCE_C, _NONCE_S, b"\x01" * 8)
    checksum = chunk_checksum(_CHUNK)
    address = b"ucx-worker-address"
    view = nixl_frames.ExportedView(1 << 30, 8192, 4096, 64, "agent-0", b"nixl-metadata")
    with mock.patch("os.urandom", lambda n: b"\x07" * n):
        metadata = nixl_frames.encode_metadata(view, session_key, _NONCE_S)
    return {
        "AUTH_CHALLENGE": _hex(proto.encode_auth_challenge(_NONCE_S)),
        "AUTH_RESPONSE": _hex(proto.encode_auth_response(session_id, auth_proof(session_key, _NONCE_S))),
        "AUTH_OK": _hex(proto.encode_auth_ok()),
        "LOOKUP": _hex(proto.encode_lookup(7, [_CHUNK_KEY, _CHUNK_KEY[::-1]])),
        "LOOKUP_REPLY": _hex(proto.encode_lookup_reply(7, 1)),
        "FETCH": _hex(proto.encode_fetch(8, [_CHUNK_KEY])),
        "CHUNK": _hex(proto.encode_chunk(8, _CHUNK_KEY, checksum, memoryview(_CHUNK))),
        "CHUNK_MISSING": _hex(proto.encode_chunk_missing(9, _CHUNK_KEY)),
        "ERROR": _hex(proto.encode_error(10, "bad_key", "a key of 0 bytes")),
        "CLOSE": _hex(proto.encode_close()),
        "UCX_ATTACH": _hex(proto.encode_ucx_attach(5, session_id, attach_mac(session_key, 5, address),
                                                   address)),
        "NIXL_METADATA": _hex(metadata),
        "CHUNK_AT": _hex(nixl_frames.encode_chunk_at(11, _CHUNK_KEY, checksum, 3)),
        "RELEASE": _hex(nixl_frames.encode_release([11, 12])),
    }


def _hello(identity: str) -> hs.HelloMessage:
    return hs.make_hello(fingerprint="0123456789abcdef", hash_seed="31337", kv_bytes_per_chunk=4096,
                         identity=identity, control_address=f"{identity}.pool:8100",
                         data_address=f"tcp://{identity}.pool:8200", transport="tcp",
                         run_config={"model": "golden", "tokens_per_hash": 16}, data_lanes=2,
                         model_identity=STAND_IN_IDENTITY)


def handshake_frames() -> dict[str, str]:
    """Both steps of a handshake, each way, with fixed nonces, key and hellos."""
    responder = hs.HandshakeResponder(_KEY, lambda: _hello("server"))
    initiator = hs.HandshakeInitiator(_KEY, _hello("client"))
    initiator.nonce = _NONCE_C
    step1 = initiator.step1()
    with mock.patch.object(hs, "new_nonce", lambda: _NONCE_S):
        reply1 = responder.hello(step1)
    step2 = initiator.step2(reply1)
    session, reply2 = responder.proof(step2)
    return {"step1": _json(step1), "reply1": _json(reply1), "step2": _json(step2), "reply2": _json(reply2),
            "session_id": session.session_id.hex(),
            "session_key_digest": hashlib.sha256(session.session_key).hexdigest()}


def directory_frames() -> dict[str, str]:
    """Every directory message, and the authentication of one as a link sends it."""
    _, session_key = hs.derive_session(_KEY, _NONCE_C, _NONCE_S, b"\x01" * 8)
    digest = lw.key_digest(_CHUNK_KEY)
    publish = lw.PublishBatch("0a1b", 3, False, True, ((digest, lw.tail_of(digest)), (5, 6)), (9,),
                              ((7, 8),)).to_dict()
    raw = json.dumps(publish, separators=(",", ":")).encode()  # as peers/links.py sends it
    return {
        "publish": _json(publish),
        "publish_auth": lw.location_auth(session_key, "publish", raw),
        "publish_reply": _json(lw.PublishReply(True).to_dict()),
        "locate": _json(lw.LocateQuery((digest, 5)).to_dict()),
        "locate_reply": _json(lw.LocateReply((lw.HolderClaim("server", 2),)).to_dict()),
    }


def frames() -> dict[str, str]:
    """Every recorded frame, by "<wire>/<message>"."""
    out: dict[str, str] = {}
    for wire, make in (("data", data_frames), ("handshake", handshake_frames),
                       ("directory", directory_frames)):
        out.update({f"{wire}/{name}": value for name, value in make().items()})
    return out


def shape(value: Any) -> Any:
    """A JSON value's shape: objects keep their keys, lists the shapes of their items, scalars
    become their type names."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items: list[Any] = []
        for item in value:
            if shape(item) not in items:
                items.append(shape(item))
        return items
    return "null" if value is None else type(value).__name__


@contextlib.contextmanager
def _captured() -> Iterator[list[tuple[str, Any]]]:
    """The channel frames this process encodes and decodes, as ("request"|"reply", body)."""
    seen: list[tuple[str, Any]] = []
    encode, decode = cp.encode_frame, cp.decode_body

    def encoding(obj: Any) -> bytes:
        seen.append(("request", obj))
        return encode(obj)

    def decoding(body: bytes) -> Any:
        value = decode(body)
        seen.append(("reply", value))
        return value

    with mock.patch.object(cp, "encode_frame", encoding), mock.patch.object(cp, "decode_body", decoding):
        yield seen


def channel_shapes() -> dict[str, dict[str, Any]]:
    """Request and reply shapes of every local-channel op, from a real exchange."""
    from kv_offload_sidecar.engine.client import EngineClient, RowRegion
    from kv_offload_sidecar.engine.region_file import find_region_file

    from kv_offload_testing.local_pool import LocalPool

    slot, rows = 16384, 4
    fd = os.memfd_create("kv-offload-golden-rows", os.MFD_CLOEXEC)
    os.ftruncate(fd, rows * slot)
    region = mmap.mmap(fd, rows * slot)
    os.close(fd)
    found, reason = find_region_file(memoryview(region))
    if found is None:
        raise RuntimeError(f"no region file for the golden channel exchange: {reason}")
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(1, 4)]
    with LocalPool(1, capacity_bytes=16 * slot) as pool, _captured() as seen:
        client = EngineClient.connect("127.0.0.1", pool[0].port, region=RowRegion(found, slot, rows, slot),
                                      states=pool[0].model_identity.statement())
        client.lookup(keys[:1])
        client.store(keys[:1], lambda i, view: view.__setitem__(slice(None), b"\1" * slot))
        with contextlib.suppress(KeyError):
            client.store(keys[1:2], lambda i, view: (_ for _ in ()).throw(KeyError("abort")))
        client.load(keys[:1], lambda i, view: None)
        client.store_rows(keys[1:3], [0, 1])
        client.load_rows(keys[1:3], [2, 3])
        client.cancel(["golden-job"])
        client.close()
    region.close()
    out: dict[str, dict[str, Any]] = {}
    op = None
    for kind, body in seen:
        if kind == "request":
            op = body.get("op")
            out.setdefault(op, {})["request"] = shape(body)
        elif op is not None:
            out[op].setdefault("reply", shape(body))
    return out


def record() -> dict[str, Any]:
    return {"wire_version": WIRE_VERSION, "command": RECORD_COMMAND, "frames": frames(),
            "channel": channel_shapes()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_offload_tools.wire_golden",
                                     description="Print or re-record the golden frames of every wire.")
    parser.add_argument("--write", action="store_true", help=f"write them to {RECORD_PATH}")
    parser.add_argument("--root", default=".", help="the repository root (default: .)")
    args = parser.parse_args(argv)
    text = json.dumps(record(), indent=1, sort_keys=True) + "\n"
    if not args.write:
        sys.stdout.write(text)
        return 0
    with open(os.path.join(args.root, RECORD_PATH), "w") as fh:
        fh.write(text)
    print(f"recorded the frames of wire {WIRE_VERSION} in {RECORD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["RECORD_COMMAND", "RECORD_PATH", "channel_shapes", "frames", "main", "record", "shape"]
