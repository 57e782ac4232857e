"""The fail-closed peer handshake: pool keys, hello messages, proofs, sessions.

Two HTTP steps on ``POST /v1/handshake`` (the transport lives in control/app.py
and peers/links.py; this module is pure logic). Nothing about the pool is said
to anyone who has not proven the pool key first:

1. client -> server ``{"step": "hello", "wire_version", "wire_min", "wire_max",
   "nonce": N_c, "key_ids": [...]}`` (the wire versions it speaks, ``peers/wire_window``; ids
   of the keys it holds, current first, ``pool_keys.key_id``). The server answers
   ``{"wire_version", "wire_min", "wire_max", "nonce": N_s, "key_id"}``: the id of a key both
   hold (its current one when the client has it). A client holding none of the server's keys
   is refused (``other_pool``: another pool's sidecar at a departed member's address, a pod a
   rotation missed, or any stranger), whatever wire versions it names: step 1 checks only
   their syntax, so a stranger of another version gets the very bytes of any stranger, and a
   key holder of another version learns of the mismatch in step 2, after its proof.
2. client -> server ``{"step": "proof", "nonce_client", "nonce_server",
   "hello": H_c, "proof": HMAC(K, "client" || T)}`` with ``T`` the transcript
   of both nonces, the key id and ``H_c``. The server checks the proof first (a bad one,
   a key named and not proven, is ``bad_proof`` and learns nothing), then compares ``H_c`` with
   its own hello and rejects on any difference (wire version: each hello states the highest
   one both ranges hold, ``wire_window.agree``; fingerprint -- an empty or missing one is a
   difference -- model identity (``engine/contract/model_identity``; none, or unknown weights, equals
   nothing), hash seed, kv_bytes_per_chunk) with the field diff, which only a key holder sees.
   Accepted: ``{"status": "accepted", "hello": H_s, "proof": HMAC(K, "server"
   || T || H_s)}``; the client checks that proof and runs the same comparison.

A sidecar whose engine has not stated its model identity answers 503 (a wait, not a refusal).
The hash seed never crosses the wire: a hello carries ``HMAC(K, nonces ||
seed)`` (``seal_seed``), equal on both sides only when the seeds are. Sessions:
``session_key = HKDF(K, salt = N_c || N_s, info = "kv-offload session v2" ||
key_id)``, ``session_id = sha256("kv-offload session id v2" || N_c || N_s)[:16]``.
The pool key never crosses the wire. A captured handshake cannot be replayed:
the server's nonce is fresh per step 1 and its pending entry is consumed by the
first step 2 (a second use is ``replay``), and a client nonce is accepted once.
Rejection reasons are the ``handshakes{reason}`` labels of metrics.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.engine.contract.offloading_config import identity_diff
from kv_offload_sidecar.peers.pool_keys import (  # load_pool_key: imported from here too
    KEY_ID_BYTES,
    MAX_OFFERED_KEYS,
    PoolKeys,
    hkdf,
    load_pool_key,
)
from kv_offload_sidecar.peers.wire_window import (
    SPOKEN,
    WIRE_VERSION,
    WireRange,
    agree,
    spoken_for,
    stated_range,
    wire_diff,
)
from kv_offload_sidecar.peers.wire_window import wire_major as _wire_major
from kv_offload_sidecar.rejections import clip

NONCE_BYTES = 16
# Largest data_lanes a hello may state (a sidecar offers at most data.lanes.MAX_DATA_LANES).
MAX_HELLO_LANES = 64
SESSION_ID_BYTES = 16
REASONS = ("fingerprint_mismatch", "model_mismatch", "hash_seed_mismatch", "chunk_size_mismatch",
           "wire_version_mismatch", "bad_proof", "malformed", "replay", "other_pool")
# Longest accepted string field of a hello (identity, control address, seed digest).
MAX_FIELD_CHARS = 1024
# Longest accepted data address (a UCX worker address in base64: hundreds of bytes, a few KiB
# with many devices).
MAX_DATA_ADDRESS_CHARS = 16 * 1024
# Largest handshake body, either step, request or reply: a step 1 is ~150 bytes; a step 2 holds
# a hello, whose run config lists the model's attention layers (~50 bytes each, 10 KiB for 200)
# and whose data address is at most MAX_DATA_ADDRESS_CHARS.
MAX_HANDSHAKE_BODY_BYTES = 32 * 1024
_TRANSCRIPT_LABEL = b"kv-offload handshake v2\x00"
_SEED_LABEL = b"kv-offload hash seed v2\x00"
_SESSION_INFO = b"kv-offload session v2\x00"
_SESSION_ID_LABEL = b"kv-offload session id v2"


class HandshakeError(Exception):
    """A rejected or failed handshake; ``reason`` is a metrics label."""

    def __init__(self, reason: str, message: str, diff: list[str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.diff = list(diff or [])


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def seal_seed(key: bytes, nonce_client: bytes, nonce_server: bytes, seed: str) -> str:
    """What a hello says about its hash seed: equal digests iff equal seeds (and keys)."""
    return hmac.new(key, _SEED_LABEL + nonce_client + nonce_server + seed.encode("utf-8"),
                    hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class HelloMessage:
    """What a sidecar says about itself, to key holders only (handshake step 2)."""

    # Wire version "major.minor": on the wire, the one both sides agreed in step 1.
    wire_version: str
    # Pool fingerprint (16 hex); empty means unknown and is always rejected.
    fingerprint: str
    # The prefix-hash seed: plain in a local hello, sealed (seal_seed) on the wire.
    hash_seed: str
    # Bytes of one chunk; equal sizes are required.
    kv_bytes_per_chunk: int
    # Sender's unique name in the pool.
    identity: str
    # Sender's control address "host:port" (one of its DP ports).
    control_address: str
    # Sender's data-plane address ("tcp://h:p", "tls://h:p" or "ucx://...").
    data_address: str
    # Sender's data-plane kind: "tcp" or "ucx".
    transport: str
    # Sender's run config (fingerprint input), so a receiver can log a field diff.
    run_config: Mapping[str, Any] | None = None
    # Data connections the sender can run to one peer at once (``data.lanes.lanes_offered``:
    # its CPU budget, ``cpu_budget``, capped); None (a sender that states none) counts as one lane.
    data_lanes: int | None = None
    # The model identity its engine gave it (``ModelIdentity.to_dict``); None: no engine has
    # attached yet (then it shares nothing, and is refused by every peer).
    model_identity: Mapping[str, str] | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "HelloMessage":
        """Parse and validate a received hello; ``HandshakeError("malformed")`` if bad.

        A missing fingerprint parses as "" (and is then rejected as a mismatch).
        """
        if not isinstance(d, Mapping):
            raise HandshakeError("malformed", f"hello must be a JSON object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for name in ("wire_version", "hash_seed", "identity", "control_address",
                     "data_address", "transport"):
            if name not in d:
                raise HandshakeError("malformed", f"hello is missing field {name!r}")
            kwargs[name] = d[name]
        kwargs["fingerprint"] = d.get("fingerprint", "") if d.get("fingerprint") is not None else ""
        if "kv_bytes_per_chunk" not in d:
            raise HandshakeError("malformed", "hello is missing field 'kv_bytes_per_chunk'")
        kwargs["kv_bytes_per_chunk"] = d["kv_bytes_per_chunk"]
        kwargs["run_config"] = d.get("run_config")
        kwargs["data_lanes"] = d.get("data_lanes")
        kwargs["model_identity"] = d.get("model_identity")
        hello = cls(**kwargs)
        hello.validate()
        return hello

    def validate(self) -> None:
        """Type and range checks; raises ``HandshakeError("malformed", ...)``."""
        for name in ("wire_version", "fingerprint", "hash_seed", "identity",
                     "control_address", "data_address", "transport"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise HandshakeError("malformed", f"hello field {name!r} must be a string, got {type(v).__name__}")
            limit = MAX_DATA_ADDRESS_CHARS if name == "data_address" else MAX_FIELD_CHARS
            if len(v) > limit:
                raise HandshakeError("malformed", f"hello field {name!r} is longer than {limit} characters")
        if _wire_major(self.wire_version) is None:
            raise HandshakeError("malformed", f"hello wire_version {_shown(self.wire_version)} is not "
                                 f"'major.minor'")
        k = self.kv_bytes_per_chunk
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise HandshakeError("malformed", f"hello kv_bytes_per_chunk must be a positive integer, "
                                 f"got {_shown(k)}")
        if not self.identity:
            raise HandshakeError("malformed", "hello identity is empty")
        if self.transport not in ("tcp", "ucx", "nixl"):
            raise HandshakeError("malformed", f"hello transport {_shown(self.transport)} is not 'tcp', "
                                 f"'ucx' or 'nixl'")
        if self.run_config is not None and not isinstance(self.run_config, Mapping):
            raise HandshakeError("malformed", "hello run_config must be an object or absent")
        lanes = self.data_lanes
        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int)
                                  or not 1 <= lanes <= MAX_HELLO_LANES):
            raise HandshakeError("malformed", f"hello data_lanes must be an integer from 1 to "
                                 f"{MAX_HELLO_LANES} or absent, got {_shown(lanes)}")
        if self.model_identity is not None:
            try:
                ModelIdentity.from_dict(self.model_identity)
            except ValueError as exc:
                raise HandshakeError("malformed", f"hello {clip(str(exc), 200)}") from None

    @property
    def model(self) -> ModelIdentity | None:
        """The model identity this hello states (None: none)."""
        return None if self.model_identity is None else ModelIdentity.from_dict(self.model_identity)

    def sealed(self, key: bytes, nonce_client: bytes, nonce_server: bytes) -> "HelloMessage":
        """This local hello as sent: its hash seed replaced by ``seal_seed``."""
        return replace(self, hash_seed=seal_seed(key, nonce_client, nonce_server, self.hash_seed))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.data_lanes is None:  # as a sender that states none sent it (the transcript)
            del d["data_lanes"]
        if self.model_identity is None:
            del d["model_identity"]
        else:
            d["model_identity"] = dict(self.model_identity)
        if self.run_config is not None:
            d["run_config"] = json.loads(json.dumps(self.run_config))
        return d

    def canonical(self) -> bytes:
        """Deterministic bytes of this hello for the transcript."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()


def _same_text(received: str, expected: str) -> bool:
    """Constant-time equality of a received string (any characters) and an expected one."""
    return hmac.compare_digest(received.encode("utf-8", "replace"),
                               expected.encode("utf-8", "replace"))


def _shown(value: Any) -> str:
    """A received value as quoted in an error (clipped: it ends up in replies and logs)."""
    return clip(repr(value), 64)


def compare_hello(local: HelloMessage, remote: HelloMessage,
                  ranges: tuple[WireRange, WireRange] | None = None) -> tuple[str, list[str]] | None:
    """Fail-closed comparison of two sealed hellos. None when compatible, else ``(reason, diff_lines)``.

    The reason is the first failing check in the order wire version,
    fingerprint, model identity, hash seed, chunk size; the diff lists every
    difference, with an ``identity_diff`` of the run configs when both are known
    and a ``ModelIdentity.diff`` of the model identities (``weights: files:3f2a..
    != files:9c1d..``). Wire versions must be equal (each hello states the agreed one), and
    ``ranges`` (ours, theirs, from step 1) must overlap.
    """
    diff: list[str] = []
    reasons: list[str] = []
    wire = wire_diff(local.wire_version, remote.wire_version, ranges)
    if wire is not None:
        reasons.append("wire_version_mismatch")
        diff.append(wire)
    if not remote.fingerprint or not local.fingerprint or local.fingerprint != remote.fingerprint:
        reasons.append("fingerprint_mismatch")
        diff.append(f"fingerprint: {local.fingerprint or '<empty>'} != {remote.fingerprint or '<empty>'}")
        if local.run_config is not None and remote.run_config is not None:
            diff.extend(identity_diff(local.run_config, remote.run_config))
    mine, theirs = local.model, remote.model
    if mine is None or not mine.matches(theirs):
        reasons.append("model_mismatch")
        if mine is None:
            diff.append("model_identity: <none: this sidecar's engine has not attached> != "
                        + (theirs.digest if theirs is not None else "<none>"))
        else:
            diff.extend(mine.diff(theirs))
    if not _same_text(local.hash_seed, remote.hash_seed):
        reasons.append("hash_seed_mismatch")
        diff.append("hash_seed: differs (every pod of a pool must get the pool's PYTHONHASHSEED; "
                    "the seeds themselves are never sent)")
    if local.kv_bytes_per_chunk != remote.kv_bytes_per_chunk:
        reasons.append("chunk_size_mismatch")
        diff.append(f"kv_bytes_per_chunk: {local.kv_bytes_per_chunk} != {remote.kv_bytes_per_chunk}")
    if not reasons:
        return None
    return reasons[0], diff


def diff_fields(diff: list[str]) -> list[str]:
    """Field names of diff lines ("tokens_per_hash: 16 != 32" -> "tokens_per_hash")."""
    out: list[str] = []
    for line in diff:
        name = line.split(":", 1)[0]
        if name not in out:
            out.append(name)
    return out


def transcript(nonce_client: bytes, nonce_server: bytes, kid: bytes, hello_client: HelloMessage) -> bytes:
    return _TRANSCRIPT_LABEL + nonce_client + nonce_server + kid + hello_client.canonical()


def client_proof(key: bytes, t: bytes) -> str:
    return hmac.new(key, b"client\x00" + t, hashlib.sha256).hexdigest()


def server_proof(key: bytes, t: bytes, hello_server: HelloMessage) -> str:
    return hmac.new(key, b"server\x00" + t + b"\x00" + hello_server.canonical(), hashlib.sha256).hexdigest()


def derive_session(key: bytes, nonce_client: bytes, nonce_server: bytes,
                   kid: bytes = b"") -> tuple[bytes, bytes]:
    """``(session_id, session_key)`` of the data connections and directory messages of one handshake."""
    skey = hkdf(key, nonce_client + nonce_server, _SESSION_INFO + kid)
    sid = hashlib.sha256(_SESSION_ID_LABEL + nonce_client + nonce_server).digest()[:SESSION_ID_BYTES]
    return sid, skey


@dataclass(frozen=True)
class Session:
    """An authenticated relation with one peer, from one handshake."""

    # 16 bytes naming the session on data connections (not secret).
    session_id: bytes
    # HMAC key of the session's data connections (secret).
    session_key: bytes = field(repr=False)
    # The peer's validated (sealed) hello.
    peer: HelloMessage = field(repr=False)
    # "inbound" (the peer dialled us) or "outbound" (we dialled it).
    direction: str = "outbound"
    # Id of the pool key the session was made with (it ends when that key is retired).
    key_id: bytes = b""


def _hex_field(body: Mapping[str, Any], name: str, nbytes: int) -> bytes:
    v = body.get(name)
    if not isinstance(v, str) or len(v) != 2 * nbytes:
        raise HandshakeError("malformed", f"handshake field {name!r} must be {nbytes} bytes of hex")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise HandshakeError("malformed", f"handshake field {name!r} is not hex") from None


def _stated(body: Mapping[str, Any]) -> WireRange:
    """Step 1: the range a side states (``wire_window.stated_range``), checked for syntax only;
    which versions are compared only after the proof (``compare_hello``), so nothing before it
    depends on this sidecar's versions."""
    try:
        return stated_range(body)
    except ValueError as exc:
        raise HandshakeError("malformed", str(exc)) from None


def _as_keys(keys: PoolKeys | bytes) -> PoolKeys:
    return keys if isinstance(keys, PoolKeys) else PoolKeys(keys)


class HandshakeResponder:
    """Server side of the two-step handshake (thread-unsafe; one event loop)."""

    def __init__(self, keys: PoolKeys | bytes, local_hello: Callable[[], HelloMessage],
                 *, ttl_seconds: float = 10.0, max_pending: int = 4096) -> None:
        self.keys = _as_keys(keys)
        self._local_hello = local_hello
        self._ttl = ttl_seconds
        self._max = max_pending
        # nonce_server -> (nonce_client, key id, expiry, the client's wire range)
        self._pending: OrderedDict[bytes, tuple[bytes, bytes, float, WireRange]] = OrderedDict()
        # consumed server nonces and seen client nonces -> expiry
        self._used: OrderedDict[bytes, float] = OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        for table in (self._pending, self._used):
            while table:
                k = next(iter(table))
                v = table[k]
                exp = v[2] if isinstance(v, tuple) else v
                if exp > now and len(table) <= self._max:
                    break
                table.popitem(last=False)

    def hello(self, body: Any) -> dict[str, Any]:
        """Step 1: nonces and the key to use; raises HandshakeError. Says nothing about the pool."""
        self._expire()
        if not isinstance(body, Mapping):
            raise HandshakeError("malformed", "handshake body must be a JSON object")
        theirs = _stated(body)
        nonce_c = _hex_field(body, "nonce", NONCE_BYTES)
        offered = body.get("key_ids")
        if not isinstance(offered, list) or not 0 < len(offered) <= MAX_OFFERED_KEYS:
            raise HandshakeError("malformed", f"handshake 'key_ids' must list 1..{MAX_OFFERED_KEYS} key ids")
        ids = [_hex_field({"key_id": k}, "key_id", KEY_ID_BYTES) for k in offered]
        kid = self.keys.choose(ids)
        if kid is None:
            raise HandshakeError("other_pool", "handshake rejected (other_pool): the peer holds none of "
                                 "this pool's keys")
        if nonce_c in self._used:
            raise HandshakeError("replay", "handshake rejected (replay): client nonce already used")
        self._used[nonce_c] = time.monotonic() + max(self._ttl, 60.0)
        nonce_s = new_nonce()
        self._pending[nonce_s] = (nonce_c, kid, time.monotonic() + self._ttl, theirs)
        return {**SPOKEN.step1(), "nonce": nonce_s.hex(), "key_id": kid.hex()}

    def proof(self, body: Any) -> tuple[Session, dict[str, Any]]:
        """Step 2: the inbound session and the reply; raises HandshakeError."""
        self._expire()
        if not isinstance(body, Mapping):
            raise HandshakeError("malformed", "handshake body must be a JSON object")
        nonce_c = _hex_field(body, "nonce_client", NONCE_BYTES)
        nonce_s = _hex_field(body, "nonce_server", NONCE_BYTES)
        proof = body.get("proof")
        if not isinstance(proof, str) or len(proof) > 128:
            raise HandshakeError("malformed", "handshake field 'proof' must be a hex string")
        entry = self._pending.pop(nonce_s, None)
        if entry is None:
            raise HandshakeError("replay", "handshake rejected (replay): unknown, expired or used server nonce")
        self._used[nonce_s] = time.monotonic() + max(self._ttl, 60.0)
        expected_c, kid, _, theirs = entry
        if expected_c != nonce_c:
            raise HandshakeError("replay", "handshake rejected (replay): client nonce does not match step 1")
        remote = HelloMessage.from_dict(body.get("hello"))
        key = self.keys.key(kid)
        t = transcript(nonce_c, nonce_s, kid, remote)
        if key is None or not _same_text(proof, client_proof(key, t)):
            raise HandshakeError("bad_proof", "handshake rejected (bad_proof): the peer does not hold "
                                 "this pool's key")
        local = self._local_hello()
        local = replace(local, wire_version=agree(SPOKEN, theirs) or local.wire_version)
        local = local.sealed(key, nonce_c, nonce_s)
        verdict = compare_hello(local, remote, (SPOKEN, theirs))
        if verdict is not None:
            reason, diff = verdict
            raise HandshakeError(reason, f"handshake rejected ({reason}): fields differ: "
                                 + ", ".join(diff_fields(diff)), diff)
        sid, skey = derive_session(key, nonce_c, nonce_s, kid)
        reply = {"status": "accepted", "hello": local.to_dict(), "proof": server_proof(key, t, local)}
        return Session(sid, skey, remote, "inbound", kid), reply


class HandshakeInitiator:
    """Client side: step 1, then step 2 from the server's nonce, then the server's answer."""

    def __init__(self, keys: PoolKeys | bytes, local_hello: HelloMessage) -> None:
        self.keys = _as_keys(keys)
        self.hello = local_hello
        self.nonce = new_nonce()
        self._state: tuple[bytes, bytes, bytes, bytes] | None = None  # key, kid, nonce_s, transcript
        self._sealed: HelloMessage | None = None
        self.spoken = spoken_for(local_hello.wire_version)
        self._ranges: tuple[WireRange, WireRange] | None = None

    def step1(self) -> dict[str, Any]:
        return {"step": "hello", **self.spoken.step1(), "nonce": self.nonce.hex(),
                "key_ids": [k.hex() for k in self.keys.offered_ids()]}

    def step2(self, reply: Any) -> dict[str, Any]:
        """The proof step for the server's step-1 reply; raises HandshakeError."""
        if not isinstance(reply, Mapping):
            raise HandshakeError("malformed", "handshake reply must be an object with 'nonce' and 'key_id'")
        # no version in common: the proof goes on, the comparison names both ranges
        self._ranges = (self.spoken, _stated(reply))
        nonce_s = _hex_field(reply, "nonce", NONCE_BYTES)
        kid = _hex_field(reply, "key_id", KEY_ID_BYTES)
        key = self.keys.key(kid)
        if key is None:
            raise HandshakeError("bad_proof", "peer chose a key this sidecar does not hold")
        agreed = agree(*self._ranges) or self.hello.wire_version
        self._sealed = replace(self.hello, wire_version=agreed).sealed(key, self.nonce, nonce_s)
        t = transcript(self.nonce, nonce_s, kid, self._sealed)
        self._state = (key, kid, nonce_s, t)
        return {"step": "proof", "nonce_client": self.nonce.hex(), "nonce_server": nonce_s.hex(),
                "hello": self._sealed.to_dict(), "proof": client_proof(key, t)}

    def finish(self, reply: Any) -> tuple[HelloMessage, Session]:
        """Check the server's acceptance: its proof, then the same fail-closed comparison."""
        if self._state is None or self._sealed is None:
            raise RuntimeError("finish() before step2()")
        key, kid, nonce_s, t = self._state
        if not isinstance(reply, Mapping) or not isinstance(reply.get("proof"), str):
            raise HandshakeError("malformed", "handshake acceptance must be an object with 'hello' and 'proof'")
        remote = HelloMessage.from_dict(reply.get("hello"))
        if not _same_text(reply["proof"], server_proof(key, t, remote)):
            raise HandshakeError("bad_proof", f"peer {_shown(remote.identity)} rejected (bad_proof): "
                                 f"it does not hold this pool's key")
        verdict = compare_hello(self._sealed, remote, self._ranges)
        if verdict is not None:
            reason, diff = verdict
            raise HandshakeError(reason, f"peer {_shown(remote.identity)} rejected ({reason}): "
                                 f"fields differ: "
                                 + ", ".join(diff_fields(diff)), diff)
        sid, skey = derive_session(key, self.nonce, nonce_s, kid)
        return remote, Session(sid, skey, remote, "outbound", kid)


def make_hello(*, fingerprint: str, hash_seed: str, kv_bytes_per_chunk: int, identity: str,
               control_address: str, data_address: str, transport: str,
               run_config: Mapping[str, Any] | None = None,
               data_lanes: int | None = None,
               model_identity: ModelIdentity | None = None) -> HelloMessage:
    """A local hello (its plain hash seed is sealed per handshake)."""
    return HelloMessage(
        wire_version=WIRE_VERSION, fingerprint=fingerprint, hash_seed=hash_seed,
        kv_bytes_per_chunk=kv_bytes_per_chunk, identity=identity,
        control_address=control_address, data_address=data_address, transport=transport,
        run_config=run_config, data_lanes=data_lanes,
        model_identity=None if model_identity is None else model_identity.to_dict())


__all__ = [
    "HandshakeError", "HandshakeInitiator", "HandshakeResponder", "HelloMessage", "Session",
    "compare_hello", "derive_session", "diff_fields", "load_pool_key", "make_hello", "seal_seed",
    "MAX_HANDSHAKE_BODY_BYTES", "REASONS", "WIRE_VERSION",
]
