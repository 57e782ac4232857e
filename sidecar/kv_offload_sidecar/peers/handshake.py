"""The fail-closed peer handshake: pool key, hello messages, proofs, sessions.

Two HTTP steps on ``POST /v1/handshake`` (the transport lives in control.py
and peers.py; this module is pure logic):

1. client -> server ``{"step": "hello", "hello": H_c}``. The server compares
   ``H_c`` with its own identity and rejects on any difference (wire major
   version, fingerprint -- an empty or missing one is a difference -- hash
   seed, kv_bytes_per_chunk). Otherwise it answers ``{"hello": H_s,
   "proof": HMAC(key, "server" || T)}`` where ``T`` is the transcript of both
   hellos (with their fresh 16-byte nonces).
2. The client runs the same comparison on ``H_s`` and checks the server
   proof, then sends ``{"step": "proof", "nonce_client", "nonce_server",
   "proof": HMAC(key, "client" || T)}``. The server checks it and both sides
   derive the session: ``session_key = HMAC(key, "kv-offload session" ||
   nonce_c || nonce_s)``, ``session_id = sha256("kv-offload session id" ||
   nonce_c || nonce_s)[:16]``.

The pool key never crosses the wire. A captured handshake cannot be replayed:
the server's nonce is fresh per step 1 and its pending entry is consumed by
the first step 2 (a second use is ``replay``), and a client nonce is accepted
once. Rejection reasons are the ``handshakes{reason}`` labels of metrics.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_offload_sidecar.engine.offloading_config import identity_diff

WIRE_MAJOR = 1
WIRE_MINOR = 0
WIRE_VERSION = f"{WIRE_MAJOR}.{WIRE_MINOR}"
NONCE_BYTES = 16
SESSION_ID_BYTES = 16
REASONS = ("fingerprint_mismatch", "hash_seed_mismatch", "chunk_size_mismatch",
           "wire_version_mismatch", "bad_proof", "malformed", "replay")
# Longest accepted string field of a hello (identity, control address, seed).
MAX_FIELD_CHARS = 4096
# Longest accepted data address (a UCX worker address in base64 can be long).
MAX_DATA_ADDRESS_CHARS = 96 * 1024
_TRANSCRIPT_LABEL = b"kv-offload handshake v1\x00"


class HandshakeError(Exception):
    """A rejected or failed handshake; ``reason`` is a metrics label."""

    def __init__(self, reason: str, message: str, diff: list[str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.diff = list(diff or [])


def load_pool_key(path: str) -> bytes:
    """Read the pool key file (the Secret's key, mounted as a file).

    Surrounding whitespace is stripped. Raises ``ValueError`` naming the file
    and what to do when it is missing, unreadable or empty.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 20)
    except FileNotFoundError:
        raise ValueError(
            f"pool key file {path!r} does not exist: mount the pool's Secret there "
            f"or pass --pool-key-file with its path") from None
    except OSError as exc:
        raise ValueError(
            f"pool key file {path!r} is unreadable ({exc.strerror}): "
            f"make it readable by the sidecar's user") from None
    key = data.strip()
    if not key:
        raise ValueError(
            f"pool key file {path!r} is empty: it must hold the pool's secret key "
            f"(the operator writes it into the pool's Secret)")
    return key


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


@dataclass(frozen=True)
class HelloMessage:
    """What a sidecar says about itself before anything else is exchanged."""

    # Wire version "major.minor"; majors must be equal.
    wire_version: str
    # Pool fingerprint (16 hex); empty means unknown and is always rejected.
    fingerprint: str
    # Effective prefix-hash seed (see settings.effective_hash_seed).
    hash_seed: str
    # Bytes of one chunk; equal sizes are required.
    kv_bytes_per_chunk: int
    # Sender's unique name in the pool.
    identity: str
    # Sender's control address "host:port" (one of its DP ports).
    control_address: str
    # Sender's data-plane address ("tcp://h:p" or "ucx://...").
    data_address: str
    # Sender's data-plane kind: "tcp" or "ucx".
    transport: str
    # Fresh random nonce, hex of 16 bytes.
    nonce: str
    # Sender's run config (fingerprint input), so a receiver can log a field diff.
    run_config: Mapping[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "HelloMessage":
        """Parse and validate a received hello; ``HandshakeError("malformed")`` if bad.

        A missing fingerprint parses as "" (and is then rejected as a mismatch).
        """
        if not isinstance(d, Mapping):
            raise HandshakeError("malformed", f"hello must be a JSON object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for name in ("wire_version", "hash_seed", "identity", "control_address",
                     "data_address", "transport", "nonce"):
            if name not in d:
                raise HandshakeError("malformed", f"hello is missing field {name!r}")
            kwargs[name] = d[name]
        kwargs["fingerprint"] = d.get("fingerprint", "") if d.get("fingerprint") is not None else ""
        if "kv_bytes_per_chunk" not in d:
            raise HandshakeError("malformed", "hello is missing field 'kv_bytes_per_chunk'")
        kwargs["kv_bytes_per_chunk"] = d["kv_bytes_per_chunk"]
        kwargs["run_config"] = d.get("run_config")
        hello = cls(**kwargs)
        hello.validate()
        return hello

    def validate(self) -> None:
        """Type and range checks; raises ``HandshakeError("malformed", ...)``."""
        for name in ("wire_version", "fingerprint", "hash_seed", "identity",
                     "control_address", "data_address", "transport", "nonce"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise HandshakeError("malformed", f"hello field {name!r} must be a string, got {type(v).__name__}")
            limit = MAX_DATA_ADDRESS_CHARS if name == "data_address" else MAX_FIELD_CHARS
            if len(v) > limit:
                raise HandshakeError("malformed", f"hello field {name!r} is longer than {limit} characters")
        if _wire_major(self.wire_version) is None:
            raise HandshakeError("malformed", f"hello wire_version {self.wire_version!r} is not 'major.minor'")
        k = self.kv_bytes_per_chunk
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise HandshakeError("malformed", f"hello kv_bytes_per_chunk must be a positive integer, got {k!r}")
        if not self.identity:
            raise HandshakeError("malformed", "hello identity is empty")
        if self.transport not in ("tcp", "ucx"):
            raise HandshakeError("malformed", f"hello transport {self.transport!r} is not 'tcp' or 'ucx'")
        try:
            nonce = bytes.fromhex(self.nonce)
        except ValueError:
            nonce = b""
        if len(nonce) != NONCE_BYTES:
            raise HandshakeError("malformed", f"hello nonce must be {NONCE_BYTES} bytes of hex")
        if self.run_config is not None and not isinstance(self.run_config, Mapping):
            raise HandshakeError("malformed", "hello run_config must be an object or absent")

    @property
    def nonce_bytes(self) -> bytes:
        return bytes.fromhex(self.nonce)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.run_config is not None:
            d["run_config"] = json.loads(json.dumps(self.run_config))
        return d

    def canonical(self) -> bytes:
        """Deterministic bytes of this hello for the transcript."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()


def _wire_major(version: str) -> int | None:
    parts = version.split(".")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return int(parts[0])


def compare_hello(local: HelloMessage, remote: HelloMessage) -> tuple[str, list[str]] | None:
    """Fail-closed comparison. None when compatible, else ``(reason, diff_lines)``.

    The reason is the first failing check in the order wire version,
    fingerprint, hash seed, chunk size; the diff lists every difference, with
    an ``identity_diff`` of the run configs when both are known.
    """
    diff: list[str] = []
    reasons: list[str] = []
    if _wire_major(local.wire_version) != _wire_major(remote.wire_version):
        reasons.append("wire_version_mismatch")
        diff.append(f"wire_version: {local.wire_version} != {remote.wire_version}")
    if not remote.fingerprint or not local.fingerprint or local.fingerprint != remote.fingerprint:
        reasons.append("fingerprint_mismatch")
        diff.append(f"fingerprint: {local.fingerprint or '<empty>'} != {remote.fingerprint or '<empty>'}")
        if local.run_config is not None and remote.run_config is not None:
            diff.extend(identity_diff(local.run_config, remote.run_config))
    if local.hash_seed != remote.hash_seed:
        reasons.append("hash_seed_mismatch")
        diff.append("hash_seed: differs (set the same PYTHONHASHSEED or extra_config.hash_seed on every pod)")
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


def transcript(hello_client: HelloMessage, hello_server: HelloMessage) -> bytes:
    return _TRANSCRIPT_LABEL + hello_client.canonical() + b"\x00" + hello_server.canonical()


def server_proof(pool_key: bytes, hello_client: HelloMessage, hello_server: HelloMessage) -> str:
    return hmac.new(pool_key, b"server\x00" + transcript(hello_client, hello_server), hashlib.sha256).hexdigest()


def client_proof(pool_key: bytes, hello_client: HelloMessage, hello_server: HelloMessage) -> str:
    return hmac.new(pool_key, b"client\x00" + transcript(hello_client, hello_server), hashlib.sha256).hexdigest()


def derive_session(pool_key: bytes, nonce_client: bytes, nonce_server: bytes) -> tuple[bytes, bytes]:
    """``(session_id, session_key)`` of the data connections of one handshake."""
    key = hmac.new(pool_key, b"kv-offload session" + nonce_client + nonce_server, hashlib.sha256).digest()
    sid = hashlib.sha256(b"kv-offload session id" + nonce_client + nonce_server).digest()[:SESSION_ID_BYTES]
    return sid, key


@dataclass(frozen=True)
class Session:
    """An authenticated relation with one peer, from one handshake."""

    # 16 bytes naming the session on data connections (not secret).
    session_id: bytes
    # HMAC key of the session's data connections (secret).
    session_key: bytes = field(repr=False)
    # The peer's validated hello.
    peer: HelloMessage = field(repr=False)
    # "inbound" (the peer dialled us) or "outbound" (we dialled it).
    direction: str = "outbound"
    # time.monotonic() at establishment.
    created: float = field(default_factory=time.monotonic)


def _hex_field(body: Mapping[str, Any], name: str, nbytes: int) -> bytes:
    v = body.get(name)
    if not isinstance(v, str):
        raise HandshakeError("malformed", f"handshake field {name!r} must be a hex string")
    try:
        raw = bytes.fromhex(v)
    except ValueError:
        raise HandshakeError("malformed", f"handshake field {name!r} is not hex") from None
    if len(raw) != nbytes:
        raise HandshakeError("malformed", f"handshake field {name!r} must be {nbytes} bytes")
    return raw


class HandshakeResponder:
    """Server side of the two-step handshake (thread-unsafe; one event loop)."""

    def __init__(self, pool_key: bytes, local_hello: Callable[[], HelloMessage],
                 *, ttl_seconds: float = 10.0, max_pending: int = 4096) -> None:
        self._key = pool_key
        self._local_hello = local_hello
        self._ttl = ttl_seconds
        self._max = max_pending
        # nonce_server -> (hello_client, hello_server, expiry)
        self._pending: OrderedDict[bytes, tuple[HelloMessage, HelloMessage, float]] = OrderedDict()
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

    def hello(self, body: Any) -> tuple[HelloMessage, dict[str, Any]]:
        """Step 1. Returns the client's hello and the reply; raises HandshakeError."""
        self._expire()
        if not isinstance(body, Mapping):
            raise HandshakeError("malformed", "handshake body must be a JSON object")
        remote = HelloMessage.from_dict(body.get("hello"))
        local = self._local_hello()
        verdict = compare_hello(local, remote)
        if verdict is not None:
            reason, diff = verdict
            raise HandshakeError(reason, f"handshake rejected ({reason}): fields differ: "
                                 + ", ".join(diff_fields(diff)), diff)
        nonce_c = remote.nonce_bytes
        if nonce_c in self._used:
            raise HandshakeError("replay", "handshake rejected (replay): client nonce already used")
        self._used[nonce_c] = time.monotonic() + max(self._ttl, 60.0)
        self._pending[local.nonce_bytes] = (remote, local, time.monotonic() + self._ttl)
        reply = {"hello": local.to_dict(), "proof": server_proof(self._key, remote, local)}
        return remote, reply

    def proof(self, body: Any) -> Session:
        """Step 2. Returns the inbound session; raises HandshakeError."""
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
        hello_c, hello_s, _ = entry
        if hello_c.nonce_bytes != nonce_c:
            raise HandshakeError("replay", "handshake rejected (replay): client nonce does not match step 1")
        if not hmac.compare_digest(proof, client_proof(self._key, hello_c, hello_s)):
            raise HandshakeError("bad_proof", "handshake rejected (bad_proof): the peer does not hold this pool's key")
        sid, skey = derive_session(self._key, nonce_c, nonce_s)
        return Session(sid, skey, hello_c, "inbound")


class HandshakeInitiator:
    """Client side: builds step 1, checks the reply, builds step 2."""

    def __init__(self, pool_key: bytes, local_hello: HelloMessage) -> None:
        self._key = pool_key
        self.hello = local_hello

    def step1(self) -> dict[str, Any]:
        return {"step": "hello", "hello": self.hello.to_dict()}

    def check_reply(self, reply: Any) -> tuple[HelloMessage, dict[str, Any], Session]:
        """Validate the server's hello and proof.

        Returns ``(server_hello, step2_body, outbound_session)``. On a
        mismatch raises HandshakeError; on a bad server proof too, but the
        step-2 body is still attached as ``exc.step2`` so the caller can let
        the server count the rejection.
        """
        if not isinstance(reply, Mapping) or not isinstance(reply.get("proof"), str):
            raise HandshakeError("malformed", "handshake reply must be an object with 'hello' and 'proof'")
        remote = HelloMessage.from_dict(reply.get("hello"))
        verdict = compare_hello(self.hello, remote)
        if verdict is not None:
            reason, diff = verdict
            raise HandshakeError(reason, f"peer {remote.identity!r} rejected ({reason}): fields differ: "
                                 + ", ".join(diff_fields(diff)), diff)
        step2 = {"step": "proof", "nonce_client": self.hello.nonce, "nonce_server": remote.nonce,
                 "proof": client_proof(self._key, self.hello, remote)}
        if not hmac.compare_digest(reply["proof"], server_proof(self._key, self.hello, remote)):
            err = HandshakeError("bad_proof", f"peer {remote.identity!r} rejected (bad_proof): "
                                 f"it does not hold this pool's key")
            err.step2 = step2  # type: ignore[attr-defined]
            raise err
        sid, skey = derive_session(self._key, self.hello.nonce_bytes, remote.nonce_bytes)
        return remote, step2, Session(sid, skey, remote, "outbound")


def make_hello(*, fingerprint: str, hash_seed: str, kv_bytes_per_chunk: int, identity: str,
               control_address: str, data_address: str, transport: str,
               run_config: Mapping[str, Any] | None = None, nonce: bytes | None = None) -> HelloMessage:
    """A fresh local hello (new nonce unless one is given)."""
    return HelloMessage(
        wire_version=WIRE_VERSION, fingerprint=fingerprint, hash_seed=hash_seed,
        kv_bytes_per_chunk=kv_bytes_per_chunk, identity=identity,
        control_address=control_address, data_address=data_address, transport=transport,
        nonce=(nonce or new_nonce()).hex(), run_config=run_config)


__all__ = [
    "HandshakeError", "HandshakeInitiator", "HandshakeResponder", "HelloMessage", "Session",
    "compare_hello", "derive_session", "diff_fields", "load_pool_key", "make_hello",
    "REASONS", "WIRE_VERSION",
]
