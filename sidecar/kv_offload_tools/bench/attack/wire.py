"""One-shot attacks on the data port, the local channel, and from another pool's sidecar.

- ``data_frames``: before authentication, bad magic, another wire major, unknown
  types, a 2**63-byte length, a FETCH of a stored chunk, a CHUNK, a forged
  AUTH_RESPONSE, a complete 64 KiB AUTH_RESPONSE and random bytes, each on a
  fresh connection to the target's data address (tcp, or nixl's request port):
  each must get an ERROR frame and a close, never a chunk byte.
  A ucx sidecar's address is a UCX worker address a stranger only learns after
  the proof (it is in the server's step-2 hello), so no stranger reaches it.
- ``local_garbage``: deep JSON, a 5000-digit timeout, an over-long length, bytes
  that are not JSON on the local channel socket: each must get an ``ok: false``
  answer rather than a dropped connection.
- ``other_pool_member``: a real sidecar of another pool (same config, another
  key) dialling the members; they must refuse it and never connect to it.
- ``other_weights_member``: a real sidecar holding the pool's key and config whose
  engine runs other weights under the same model name and path (a rollout to
  retrained weights): the members must refuse it (``model_mismatch``), and its
  engine's lookups of the honest load's chunks must get no byte.
"""

from __future__ import annotations

import json
import os
import time

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.peers.handshake import HandshakeError

from kv_offload_tools.bench.attack.context import AttackContext, measured
from kv_offload_tools.bench.attack.exchange import data_exchange, local_exchange
from kv_offload_tools.bench.attack.sockets import frame_names
from kv_offload_tools.chaos.chunks import chunk_keys
from kv_offload_tools.chaos.probes import probe_handshake
from kv_offload_testing.local_pool import SidecarOverride
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY

# Seconds a sidecar of another pool is given to be refused by the members.
OTHER_POOL_SECONDS = 30.0


def _header(mtype: int, length: int, magic: bytes = proto.MAGIC, major: int = proto.WIRE_MAJOR) -> bytes:
    return proto.HEADER.pack(magic, major, mtype, 0, length)


def data_cases(chunk_bytes: int) -> list[tuple[str, bytes]]:
    """(name, bytes a stranger sends after connecting) of every malformed pre-auth frame."""
    T = proto.MessageType
    stored = chunk_keys("honest/0", 1)
    return [
        ("bad magic", _header(T.AUTH_RESPONSE, 50, magic=b"XX") + bytes(50)),
        ("wire major 9", _header(T.AUTH_RESPONSE, 50, major=9) + bytes(50)),
        ("unknown type 200", _header(200, 8) + bytes(8)),
        ("length 2**63", _header(T.AUTH_RESPONSE, 1 << 63)),
        ("FETCH before auth", b"".join(bytes(p) for p in proto.encode_fetch(1, stored))),
        ("CHUNK before auth", _header(T.CHUNK, chunk_bytes + 30) + bytes(64)),
        ("forged AUTH_RESPONSE", b"".join(bytes(p) for p in
                                         proto.encode_auth_response(os.urandom(16), os.urandom(32)))),
        ("AUTH_RESPONSE 64 KiB", _header(T.AUTH_RESPONSE, 64 << 10) + bytes(64 << 10)),
        ("random bytes", os.urandom(100)),
    ]


def data_frames(ctx: AttackContext) -> None:
    if ctx.data_address.startswith("ucx://"):
        ctx.progress("  data frames: skipped, a ucx worker address is only told after the proof")
        return
    plane = ctx.data_address.split("://", 1)[0]
    with measured(ctx, f"malformed frames ({plane})", "data") as result:
        for i in ctx.rounds(ctx.repeats, result):
            for name, payload in data_cases(ctx.pool.chunk_bytes):
                answer = data_exchange(ctx.data_address, payload, ctx.source(i))
                result.sent += 1
                result.answer(f"{name}: {answer.word}")
                if "CHUNK" in frame_names(answer.data):
                    result.note(f"{name}: a CHUNK frame came back before authentication")


def _frame(body: bytes) -> bytes:
    return cp.LENGTH.pack(len(body)) + body


def local_cases() -> list[tuple[str, bytes]]:
    digits = "9" * 5000
    return [
        ("deep array", _frame(b"[" * 100_000 + b"]" * 100_000)),
        ("deep keys", _frame(b'{"op": "lookup", "keys": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")),
        ("5000-digit timeout", _frame(f'{{"op": "lookup", "keys": [], "timeout": {digits}}}'.encode())),
        ("length over the limit", cp.LENGTH.pack(cp.MAX_FRAME_BYTES + 1)),
        ("not JSON", _frame(b"\xff\xfe not json")),
        ("not an object", _frame(b"[1, 2, 3]")),
        ("200 kB op", _frame(json.dumps({"op": "x" * 200_000}).encode())),
    ]


def local_garbage(ctx: AttackContext) -> None:
    with measured(ctx, "local channel garbage", "local") as result:
        for _ in ctx.rounds(ctx.repeats, result):
            for name, payload in local_cases():
                answer = local_exchange(ctx.local_socket, payload)
                result.sent += 1
                result.answer(f"{name}: {answer.word}")


def other_pool_member(ctx: AttackContext) -> None:
    """A sidecar holding another pool's key dials the target and another member."""
    other_key = b"another pool's key, not this one"
    members = ctx.pool.members()
    with measured(ctx, "member of another pool", "pool") as result:
        before = ctx.target.metric("kv_offload_handshakes_total", result="rejected")
        foreign = ctx.pool.add(SidecarOverride(pool_key=other_key), identity="other-pool",
                               peers=[m.identity for m in members[:2]], wait_connected=False)
        try:
            deadline = time.monotonic() + OTHER_POOL_SECONDS
            rejected = 0.0
            while time.monotonic() < deadline:
                rejected = ctx.target.metric("kv_offload_handshakes_total", result="rejected") - before
                if rejected >= 2:
                    break
                time.sleep(0.2)
            result.sent = int(rejected)
            result.answers[f"handshakes refused by {ctx.target.identity}"] = int(rejected)
            joined = [m.identity for m in members
                      if any(p.get("identity") == "other-pool" and p.get("state") == "connected"
                             for p in m.peers())]
            own = [p["identity"] for p in foreign.peers() if p.get("state") == "connected"]
            result.note(f"members connected to it: {joined or 'none'}; it is connected to: {own or 'none'}")
            try:
                probe_handshake(ctx.target, other_key, ctx.pool.local_hello(identity="other-pool-probe"))
                result.answer("hand-driven handshake ACCEPTED")
                result.note("a handshake with another pool's key was accepted")
            except HandshakeError as exc:
                result.answer(f"hand-driven handshake refused ({exc.reason})")
                if "!=" in str(exc):
                    result.note(f"the refusal told another pool's member a field diff: {str(exc)[:160]}")
        finally:
            foreign.terminate()


# The stand-in engines' identity with other weights under the same name and path.
OTHER_WEIGHTS = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "weights": "files:0therwe1ghts0000"})
# Honest rounds whose chunks the other-weights sidecar's engine asks for (the latest ones).
OTHER_WEIGHTS_ROUNDS = 16


def other_weights_member(ctx: AttackContext, chunks_per_round: int = 4) -> int:
    """A key holder whose engine runs other weights dials the members and asks for the honest
    load's chunks; returns the chunk bytes it received (must be 0)."""
    members = [m for m in ctx.pool.members() if m is not ctx.target]
    before = ctx.target.metric("kv_offload_handshakes_total", result="rejected", reason="model_mismatch")
    with measured(ctx, "other weights, same name and path", "pool") as result:
        other = ctx.pool.add(SidecarOverride(model_identity=OTHER_WEIGHTS), identity="other-weights",
                             peers=[ctx.target.identity, *(m.identity for m in members[:1])],
                             wait_connected=False)
        try:
            deadline = time.monotonic() + OTHER_POOL_SECONDS
            refused = 0.0
            while time.monotonic() < deadline and refused < 1:
                refused = ctx.target.metric("kv_offload_handshakes_total", result="rejected",
                                            reason="model_mismatch") - before
                time.sleep(0.2)
            result.answers[f"handshakes refused by {ctx.target.identity} (model_mismatch)"] = int(refused)
            rounds = len(ctx.honest.rounds)
            keys = [k for r in range(max(0, rounds - OTHER_WEIGHTS_ROUNDS), rounds)
                    for k in chunk_keys(f"honest/{r}", chunks_per_round)]
            with other.client() as engine:
                for i in range(0, len(keys), chunks_per_round):
                    reply = engine.lookup(keys[i:i + chunks_per_round])
                    result.sent += 1
                    result.answers[f"lookup: {reply.peer} peer hits"] = \
                        result.answers.get(f"lookup: {reply.peer} peer hits", 0) + 1
            received = int(other.metric("kv_offload_peer_bytes_total", direction="received"))
            result.answers[f"chunk bytes received: {received}"] = 1
            if refused < 1:
                result.note("the members did not refuse a sidecar of other weights")
            if received:
                result.note(f"a sidecar of other weights RECEIVED {received} chunk bytes")
            return received
        finally:
            other.terminate()
