"""Hypothesis fuzzing of every message a live sidecar accepts.

Targets (each a ``FuzzTarget``: a hypothesis strategy of cases and a function
that sends one case to the live sidecar and judges the answer):

- ``handshake``: ``POST /v1/handshake`` bodies: mutated hellos (fields
  dropped, retyped, oversized, other fingerprints/seeds/sizes), proof steps,
  arbitrary JSON and bytes;
- ``summary``: ``GET /v1/summary`` with arbitrary query and session headers;
- ``lookup``: ``POST /v1/lookup`` bodies;
- ``local``: local-channel frames (every op with arbitrary fields, broken
  JSON, lying lengths) on the engine's Unix socket;
- ``data_preauth``: arbitrary bytes and frames on a data connection before
  authentication;
- ``data_frames``: arbitrary frame streams (LOOKUP, FETCH, CLOSE, every other
  type, wrong lengths) on an authenticated data connection.

Each case must end in a clear error (HTTP 4xx with a JSON ``error``,
``{"ok": false, "error"}``, an ERROR frame then a closed connection) or in
the correct answer, computed independently: the sidecar holds a known set of
chunks whose bytes are ``chunk_content(key)``. A 5xx, a wrong answer, a
chunk byte before authentication, a dead process or a sidecar that stops
answering ``/healthz`` is a failure; the RSS of the process is sampled from
``/proc`` and must stay within ``rss_bound_bytes`` of its value after warm-up.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HelloMessage,
    compare_hello,
    server_proof,
)
from kv_offload_sidecar.store.checksum import chunk_checksum

from kv_offload_tools.bench.chaos_support import (
    ChaosPool,
    RawDataConnection,
    SidecarProcess,
    chunk_content,
    probe_handshake,
)

# Prefix of the keys the fuzzed sidecar holds; fuzz-made keys never start with it.
HELD_PREFIX = b"\xaa\xaa\xaa\xaa"
# Prefix of keys known to be absent.
ABSENT_PREFIX = b"\xbb\xbb\xbb\xbb"
# Keys the fuzzed sidecar holds.
HELD_COUNT = 12
# Bytes of one chunk in the fuzz pool (small: fuzzing moves many).
FUZZ_CHUNK_BYTES = 4096
# Seconds a reply may take before the case counts as a hang.
REPLY_TIMEOUT = 5.0
# Default bound on RSS growth across a run (bytes).
DEFAULT_RSS_BOUND = 64 << 20
# Seconds the handshake responder remembers a used client nonce (handshake.py: max(ttl, 60)).
# A step 1 replayed later is answered again; it is harmless, since step 2 needs the pool key
# and a fresh, single-use server nonce.
REPLAY_WINDOW_SECONDS = 60.0
# Local channel length prefix.
_LEN = struct.Struct("!I")


class FuzzFailure(AssertionError):
    """A case got a wrong answer, a 5xx, no answer, or the sidecar died."""


@dataclass
class TargetStats:
    """Outcomes of one target."""

    # Target name.
    target: str
    # Cases sent.
    cases: int = 0
    # Cases answered correctly.
    answers: int = 0
    # Cases refused with a clear error.
    errors: int = 0
    # Cases where the input was incomplete and the fuzzer hung up (the sidecar waited for more).
    incomplete: int = 0
    # Failures (wrong answer, 5xx, hang, crash); must be 0.
    failures: int = 0
    # First failure, for the report.
    first_failure: str = ""
    # Wall-clock seconds of the target.
    seconds: float = 0.0


@dataclass
class FuzzResult:
    """The figures of one fuzz run."""

    # Per-target outcomes.
    targets: list[TargetStats] = field(default_factory=list)
    # RSS of the sidecar after warm-up and at the end, and the highest seen (bytes).
    rss_start_bytes: int = 0
    rss_end_bytes: int = 0
    rss_peak_bytes: int = 0
    # Allowed growth (bytes).
    rss_bound_bytes: int = DEFAULT_RSS_BOUND
    # Times the sidecar process died (must be 0).
    crashes: int = 0
    # Times /healthz did not answer within REPLY_TIMEOUT (must be 0).
    hangs: int = 0
    # Wall-clock seconds.
    seconds: float = 0.0
    # RSS samples (case number, bytes) for the plot.
    rss_series: list[tuple[int, int]] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return sum(t.cases for t in self.targets)

    @property
    def failures(self) -> int:
        return sum(t.failures for t in self.targets)

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_end_bytes - self.rss_start_bytes

    @property
    def ok(self) -> bool:
        return (self.failures == 0 and self.crashes == 0 and self.hangs == 0
                and self.rss_growth_bytes <= self.rss_bound_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("rss_series")
        d.update(cases=self.cases, failures=self.failures, rss_growth_bytes=self.rss_growth_bytes,
                 ok=self.ok)
        return d


# ---------------------------------------------------------------- strategies

_leaf = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
# Strings of digits, including ones str.isdigit() accepts but int() does not ("²").
odd_digits = st.text(alphabet="0123456789.-²¹³٣", max_size=8)
fuzz_keys = st.binary(min_size=0, max_size=40).filter(
    lambda k: not k.startswith(HELD_PREFIX) and not k.startswith(ABSENT_PREFIX))


def held_keys() -> list[bytes]:
    return [HELD_PREFIX + i.to_bytes(4, "big") + bytes(12) for i in range(HELD_COUNT)]


def absent_key(i: int) -> bytes:
    return ABSENT_PREFIX + i.to_bytes(4, "big") + bytes(12)


# Lists of keys an oracle can answer: held keys (in any order) and known-absent keys.
known_key_lists = st.lists(
    st.one_of(st.integers(0, HELD_COUNT - 1).map(lambda i: held_keys()[i]),
              st.integers(0, 1000).map(absent_key)),
    min_size=0, max_size=10)
hex_items = st.one_of(
    known_key_lists.map(lambda ks: [k.hex() for k in ks]),
    st.lists(st.one_of(fuzz_keys.map(bytes.hex), st.text(max_size=12), st.integers(), st.none(),
                       st.just("a" * 8193), st.just("abc")), max_size=6),
    json_values)
timeouts = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 700),
                     st.booleans(), st.text(max_size=5), st.sampled_from([0.05, 0.2, 1.0]))


def held_prefix(keys: list[bytes], extra: set[bytes] | frozenset[bytes] = frozenset()) -> int:
    """Leading keys the fuzzed sidecar holds (its held chunks plus fuzz-committed ones)."""
    held = set(held_keys())
    n = 0
    while n < len(keys) and (keys[n] in held or keys[n] in extra):
        n += 1
    return n


# ---------------------------------------------------------------- HTTP helper


class Http:
    """A keep-alive HTTP client to one control port that reconnects when needed."""

    def __init__(self, address: str) -> None:
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=REPLY_TIMEOUT)
                self.conn.connect()
                # http.client sends headers and body in two writes: without this, Nagle and
                # delayed ACKs add ~40 ms to every request.
                self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self.conn.request(method, path, body=body,
                                  headers={"Content-Type": "application/json", **(headers or {})})
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.will_close:
                    self.close()
                return resp.status, data
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self.close()
                if attempt:
                    raise
            except socket.timeout:
                self.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _json_error(status: int, data: bytes, what: str) -> None:
    """A 4xx with a JSON body carrying a non-empty 'error' string."""
    if not 400 <= status < 500:
        raise FuzzFailure(f"{what}: HTTP {status} instead of a 4xx: {data[:200]!r}")
    try:
        body = json.loads(data)
    except ValueError:
        raise FuzzFailure(f"{what}: HTTP {status} body is not JSON: {data[:200]!r}") from None
    if not isinstance(body, dict) or not isinstance(body.get("error"), str) or not body["error"]:
        raise FuzzFailure(f"{what}: HTTP {status} without an 'error' message: {body!r}")


# ---------------------------------------------------------------- targets


@dataclass
class FuzzContext:
    """The live sidecar under fuzzing and what the oracles know about it."""

    # The pool (config, key) of the sidecar.
    pool: ChaosPool
    # The sidecar process.
    sidecar: SidecarProcess
    # Keep-alive HTTP client to its control port.
    http: Http
    # Path of its local channel socket.
    socket_path: str
    # Its data-plane address.
    data_address: str
    # An authenticated session of a hand-driven peer (for data frames).
    session: Any
    # Slots of its store.
    num_slots: int
    # Client nonces that got a 200 on step 1 -> when (a reuse within the server's
    # replay window must be refused as a replay).
    seen_nonces: dict[str, float] = field(default_factory=dict)
    # Keys committed by fuzzed local-channel cases (bytes unknown, checksum must hold).
    extra_held: set[bytes] = field(default_factory=set)


def _hello_template(ctx: FuzzContext) -> dict[str, Any]:
    return ctx.pool.local_hello(identity="fuzzer", control_address="127.0.0.1:9").to_dict()


@st.composite
def handshake_cases(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["hello", "hello", "hello", "proof", "json", "bytes", "big"]))
    if kind == "hello":
        edits = draw(st.lists(st.tuples(
            st.sampled_from(["wire_version", "fingerprint", "hash_seed", "kv_bytes_per_chunk", "identity",
                             "control_address", "data_address", "transport", "nonce", "run_config", "extra"]),
            st.sampled_from(["drop", "json", "text", "int", "long"]),
            json_values, st.one_of(st.text(max_size=30), odd_digits), st.integers(-(2 ** 65), 2 ** 65)),
            max_size=3))
        nonce = draw(st.binary(min_size=16, max_size=16)).hex()
        step = draw(st.one_of(st.just("hello"), st.just("hello"), st.sampled_from(["proof", "", "HELLO"]),
                              json_values))
        return "hello", {"edits": edits, "nonce": nonce, "step": step}
    if kind == "proof":
        return "proof", {"step": "proof",
                         "nonce_client": draw(st.binary(min_size=0, max_size=20).map(bytes.hex) | json_values),
                         "nonce_server": draw(st.binary(min_size=16, max_size=16).map(bytes.hex) | json_values),
                         "proof": draw(st.text(max_size=130) | json_values)}
    if kind == "json":
        return "raw", json.dumps(draw(json_values)).encode()
    if kind == "big":
        return "raw", b'{"step": "hello", "pad": "' + b"x" * 70000 + b'"}'
    return "raw", draw(st.binary(max_size=300))


def _apply_edits(hello: dict[str, Any], edits: list[tuple]) -> dict[str, Any]:
    out = dict(hello)
    for name, action, jv, text, num in edits:
        if action == "drop":
            out.pop(name, None)
        elif action == "json":
            out[name] = jv
        elif action == "text":
            out[name] = text
        elif action == "int":
            out[name] = num
        else:
            out[name] = "y" * 5000
    return out


def run_handshake_case(ctx: FuzzContext, case: tuple[str, Any]) -> str:
    kind, payload = case
    if kind == "hello":
        hello = _apply_edits(dict(_hello_template(ctx), nonce=payload["nonce"]), payload["edits"])
        body = {"step": payload["step"], "hello": hello}
        status, data = ctx.http.request("POST", "/v1/handshake", json.dumps(body).encode())
        expected = _expected_hello_outcome(ctx, body, hello)
        if expected == "either":
            expected = "accept" if status == 200 else "replay"
        if expected == "accept":
            if status != 200:
                raise FuzzFailure(f"a compatible hello was refused: HTTP {status} {data[:300]!r}")
            reply = json.loads(data)
            server = HelloMessage.from_dict(reply.get("hello"))
            client = HelloMessage.from_dict(hello)
            if not hmac.compare_digest(reply.get("proof", ""), server_proof(ctx.pool.pool_key, client, server)):
                raise FuzzFailure("the server's proof does not verify with the pool key")
            ctx.seen_nonces[client.nonce] = time.monotonic()
            return "answer"
        _json_error(status, data, f"hello expected {expected}")
        reason = json.loads(data).get("reason")
        if expected != "malformed-step" and reason != expected:
            raise FuzzFailure(f"hello refused for {reason!r}, expected {expected!r}: {data[:300]!r}")
        return "error"
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    try:
        status, data = ctx.http.request("POST", "/v1/handshake", raw)
    except ConnectionError:
        if len(raw) > 64 * 1024:  # an oversized body may be cut off after the 413 is sent
            return "error"
        raise
    _json_error(status, data, f"handshake {kind}")
    return "error"


def _expected_hello_outcome(ctx: FuzzContext, body: dict[str, Any], hello: dict[str, Any]) -> str:
    if body["step"] != "hello":
        return "malformed-step"
    try:
        remote = HelloMessage.from_dict(hello)
    except (HandshakeError, TypeError):
        return "malformed"
    except Exception:  # a value the parser itself trips on: the server must still refuse it cleanly
        return "malformed-step"
    local = ctx.pool.local_hello(identity=ctx.sidecar.identity)
    try:
        verdict = compare_hello(local, remote)
    except Exception:  # an odd run_config the diff cannot read: the server must still refuse cleanly
        return "malformed-step"
    if verdict is not None:
        return verdict[0]
    seen = ctx.seen_nonces.get(remote.nonce)
    if seen is not None:
        age = time.monotonic() - seen
        if age < REPLAY_WINDOW_SECONDS - 10:
            return "replay"
        if age < REPLAY_WINDOW_SECONDS + 10:
            return "either"  # at the edge of the server's replay window
    return "accept"


summary_cases = st.tuples(
    st.one_of(st.integers(-5, 2 ** 70).map(str), st.text(max_size=25), odd_digits),
    st.text(max_size=70),
    st.one_of(st.none(), st.text(max_size=40), st.binary(min_size=16, max_size=16).map(bytes.hex)),
    st.one_of(st.none(), st.text(max_size=70)))


def run_summary_case(ctx: FuzzContext, case: tuple) -> str:
    since, epoch, session, auth = case
    from urllib.parse import urlencode

    headers = {}
    for name, value in (("X-KV-Offload-Session", session), ("X-KV-Offload-Auth", auth)):
        if value is not None and value.isprintable() and value.isascii():
            headers[name] = value
    status, data = ctx.http.request("GET", "/v1/summary?" + urlencode({"since": since, "epoch": epoch}),
                                    headers=headers)
    _json_error(status, data, "summary without a session")
    return "error"


lookup_cases = st.one_of(
    st.fixed_dictionaries({"keys": hex_items}, optional={"timeout": timeouts}),
    json_values.map(lambda v: ("json", v)),
    st.binary(max_size=200).map(lambda b: ("bytes", b)))


def _valid_keys(value: Any, max_keys: int) -> list[bytes] | None:
    if not isinstance(value, list) or len(value) > max_keys:
        return None
    out = []
    for item in value:
        if not isinstance(item, str):
            return None
        try:
            key = bytes.fromhex(item)
        except ValueError:
            return None
        if not 0 < len(key) <= proto.MAX_KEY_BYTES:
            return None
        out.append(key)
    return out


def _valid_timeout(value: Any, present: bool) -> bool:
    if not present:
        return True
    if value is None:
        return True  # control.parse_timeout: null means the default
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 600)


def run_lookup_case(ctx: FuzzContext, case: Any) -> str:
    if isinstance(case, tuple):
        raw = case[1] if case[0] == "bytes" else json.dumps(case[1]).encode()
        status, data = ctx.http.request("POST", "/v1/lookup", raw)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            _json_error(status, data, "lookup body that is not JSON")
            return "error"
        return _check_lookup_answer(ctx, body, status, data)
    status, data = ctx.http.request("POST", "/v1/lookup", json.dumps(case).encode())
    return _check_lookup_answer(ctx, case, status, data)


def _check_lookup_answer(ctx: FuzzContext, body: Any, status: int, data: bytes) -> str:
    keys = _valid_keys(body.get("keys"), 4096) if isinstance(body, dict) else None
    good = keys is not None and _valid_timeout(body.get("timeout"), "timeout" in body)
    if not good:
        _json_error(status, data, f"invalid lookup {json.dumps(body)[:120]}")
        return "error"
    if status != 200:
        raise FuzzFailure(f"a valid lookup got HTTP {status}: {data[:200]!r}")
    reply = json.loads(data)
    assert keys is not None
    want = held_prefix(keys, ctx.extra_held)
    if reply != {"local": want, "peer": 0}:
        raise FuzzFailure(f"lookup answered {reply} for keys whose held prefix is {want}")
    return "answer"


# local channel ---------------------------------------------------------------

well_formed_local = st.one_of(
    st.fixed_dictionaries({"op": st.sampled_from(["lookup", "load", "reserve"]),
                           "keys": known_key_lists.map(lambda ks: [k.hex() for k in ks]),
                           "timeout": st.sampled_from([0.2, 1.0])}),
    st.fixed_dictionaries({"op": st.sampled_from(["commit", "abort", "release", "info"]),
                           "id": st.integers(1, 4)}))
local_requests = st.one_of(
    well_formed_local, well_formed_local,
    st.fixed_dictionaries(
        {"op": st.sampled_from(["info", "lookup", "reserve", "commit", "abort", "load", "release",
                                "LOOKUP", "", "drop"])},
        optional={"keys": hex_items, "timeout": timeouts,
                  "id": st.one_of(st.integers(-2, 5), json_values),
                  "written": st.one_of(st.lists(st.booleans(), max_size=6), json_values)}),
    json_values.map(lambda v: ("json", v)),
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    st.integers(16 * 1024 * 1024 + 1, 2 ** 32 - 1).map(lambda n: ("length", n)))
local_cases = st.lists(local_requests, min_size=1, max_size=4)


def _local_recv(sock: socket.socket) -> dict[str, Any] | None:
    """One reply frame, or None when the sidecar closed the channel."""
    head = b""
    while len(head) < 4:
        part = sock.recv(4 - len(head))
        if not part:
            return None
        head += part
    (n,) = _LEN.unpack(head)
    if n > 16 << 20:
        raise FuzzFailure(f"local channel reply claims {n} bytes")
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise FuzzFailure("local channel closed inside a reply")
        data += part
    reply = json.loads(data)
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise FuzzFailure(f"local channel reply without 'ok': {reply!r}")
    if not reply["ok"] and not (isinstance(reply.get("error"), str) and reply["error"]):
        raise FuzzFailure(f"local channel refusal without an error message: {reply!r}")
    return reply


def run_local_case(ctx: FuzzContext, case: list) -> str:
    outcome = "answer"
    reservations: dict[int, list[bytes | None]] = {}  # id -> reserved key per position (None: no slot)
    loads: set[int] = set()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT)
        sock.connect(ctx.socket_path)
        for req in case:
            fatal = False
            if isinstance(req, tuple) and req[0] == "length":
                sock.sendall(_LEN.pack(req[1]))
                fatal = True
            elif isinstance(req, tuple):
                raw = req[1] if req[0] == "bytes" else json.dumps(req[1]).encode()
                sock.sendall(_LEN.pack(len(raw)) + raw)
                try:
                    parsed = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    parsed = None
                    fatal = True
                if not isinstance(parsed, dict) or not isinstance(parsed.get("op"), str):
                    fatal = True
                else:
                    req = parsed
            else:
                sock.sendall(_LEN.pack(len(json.dumps(req).encode())) + json.dumps(req).encode())
            try:
                reply = _local_recv(sock)
            except socket.timeout:
                raise FuzzFailure(f"no local channel reply within {REPLY_TIMEOUT}s to {str(req)[:200]}") from None
            if reply is None:
                raise FuzzFailure(f"local channel closed without a reply to {str(req)[:200]}")
            if fatal:
                if reply["ok"]:
                    raise FuzzFailure(f"a malformed frame got ok: {reply!r}")
                if _local_recv(sock) is not None:
                    raise FuzzFailure("the channel stayed open after a malformed frame")
                return "error"
            result = _judge_local(ctx, req, reply, reservations, loads)
            if result == "error":
                outcome = "error" if outcome == "answer" else outcome
    return outcome


def _judge_local(ctx: FuzzContext, req: dict[str, Any], reply: dict[str, Any],
                 reservations: dict[int, list[bytes | None]], loads: set[int]) -> str:
    op = req.get("op")
    keys = _valid_keys(req.get("keys"), 65536)
    timeout_ok = _valid_timeout(req.get("timeout"), "timeout" in req) and req.get("timeout", 1) is not None
    rid = req.get("id")
    id_ok = isinstance(rid, int) and not isinstance(rid, bool)
    expect_ok: bool
    if op == "info":
        expect_ok = True
    elif op in ("lookup", "load"):
        expect_ok = keys is not None and timeout_ok
    elif op == "reserve":
        expect_ok = keys is not None
    elif op in ("commit", "abort"):
        written = req.get("written")
        expect_ok = id_ok and rid in reservations and (
            op == "abort" or written is None
            or (isinstance(written, list) and len(written) == len(reservations[rid])))
    elif op == "release":
        expect_ok = id_ok and rid in loads
    else:
        expect_ok = False
    if reply["ok"] != expect_ok:
        raise FuzzFailure(f"local op {op!r} answered ok={reply['ok']} (expected {expect_ok}): "
                          f"request {json.dumps(req)[:200]} reply {json.dumps(reply)[:200]}")
    if not expect_ok:
        if op in ("commit", "abort") and id_ok:
            reservations.pop(rid, None)  # a bad 'written' still gives the reservation back
        return "error"
    if op == "info":
        if reply.get("store", {}).get("num_slots") != ctx.num_slots:
            raise FuzzFailure(f"info answered {reply!r}")
    elif op == "lookup":
        assert keys is not None
        want = held_prefix(keys, ctx.extra_held)
        if (reply.get("local"), reply.get("peer")) != (want, 0):
            raise FuzzFailure(f"lookup answered {reply} for held prefix {want}")
    elif op == "load":
        assert keys is not None
        slots = reply.get("slots")
        want = held_prefix(keys, ctx.extra_held)
        if not isinstance(slots, list) or len(slots) != want:
            raise FuzzFailure(f"load answered {reply} for held prefix {want}")
        loads.add(reply["id"])
    elif op == "reserve":
        assert keys is not None
        slots = reply.get("slots")
        if not isinstance(slots, list) or len(slots) != len(keys):
            raise FuzzFailure(f"reserve answered {reply} for {len(keys)} keys")
        for k, slot in zip(keys, slots):
            if (k in set(held_keys()) or k in ctx.extra_held) and slot is not None:
                raise FuzzFailure(f"reserve handed out a slot for a held key: {reply}")
            if slot is not None and not (isinstance(slot, int) and 0 <= slot < ctx.num_slots):
                raise FuzzFailure(f"reserve answered slot {slot!r}")
        reservations[reply["id"]] = [k if slot is not None else None for k, slot in zip(keys, slots)]
    elif op in ("commit", "abort"):
        reserved = reservations.pop(rid, [])
        if op == "commit":
            written = req.get("written")
            for i, k in enumerate(reserved):
                if k is not None and (written is None or written[i] is True):
                    ctx.extra_held.add(k)
    elif op == "release":
        loads.discard(rid)
    return "answer"


# data plane --------------------------------------------------------------------

frame_parts = st.tuples(
    st.one_of(st.just(proto.MAGIC), st.binary(min_size=2, max_size=2)),
    st.one_of(st.just(proto.WIRE_MAJOR), st.integers(0, 255)),
    st.one_of(st.sampled_from([int(t) for t in proto.MessageType]), st.integers(0, 255)),
    st.integers(0, 2 ** 32 - 1),
    st.one_of(known_key_lists.map(lambda ks: proto.encode_keys(ks)), st.binary(max_size=80)),
    st.one_of(st.none(), st.integers(0, 2 ** 64 - 1), st.integers(0, 100)))
valid_requests = st.tuples(
    st.sampled_from([proto.MessageType.LOOKUP, proto.MessageType.FETCH]),
    st.integers(0, 2 ** 32 - 1), known_key_lists.filter(lambda ks: len(ks) <= 8))


def _frame_bytes(part: Any) -> bytes:
    if isinstance(part, tuple) and isinstance(part[0], proto.MessageType):
        mtype, rid, keys = part
        return b"".join(proto.encode_lookup(rid, keys) if mtype is proto.MessageType.LOOKUP
                        else proto.encode_fetch(rid, keys))
    magic, major, mtype, rid, payload, length = part
    n = len(payload) if length is None else length
    return proto.HEADER.pack(magic, major, mtype, rid, n) + payload


data_streams = st.lists(st.one_of(valid_requests, valid_requests, frame_parts), min_size=1, max_size=5)
preauth_streams = st.one_of(st.binary(min_size=1, max_size=100),
                            st.lists(frame_parts, min_size=1, max_size=2).map(lambda ps: b"".join(map(_frame_bytes, ps))))


@dataclass
class _Expected:
    """What a correct server answers to a byte stream (a model of the protocol)."""

    # Replies in order: ("lookup", rid, count) or ("chunk", rid, key) or ("missing", rid, key).
    replies: list[tuple[str, int, Any]]
    # "error" (a complete bad frame), "close" (CLOSE sent), "incomplete" or "open".
    ending: str


def model_stream(stream: bytes, chunk_bytes: int, extra_held: set[bytes] | frozenset[bytes] = frozenset()
                 ) -> _Expected:
    """Parse ``stream`` as the server must and list the answers it owes."""
    replies: list[tuple[str, int, Any]] = []
    pos = 0
    held = set(held_keys()) | set(extra_held)
    while True:
        if pos == len(stream):
            return _Expected(replies, "open")
        if pos + proto.HEADER_BYTES > len(stream):
            return _Expected(replies, "incomplete")
        try:
            header = proto.decode_header(stream[pos:pos + proto.HEADER_BYTES], chunk_bytes)
        except proto.ProtocolError:
            return _Expected(replies, "error")
        pos += proto.HEADER_BYTES
        if header.type is not proto.MessageType.CHUNK:
            if pos + header.length > len(stream):
                return _Expected(replies, "incomplete")
            payload = stream[pos:pos + header.length]
            pos += header.length
        else:
            return _Expected(replies, "error")
        if header.type is proto.MessageType.CLOSE:
            return _Expected(replies, "close")
        if header.type not in (proto.MessageType.LOOKUP, proto.MessageType.FETCH):
            return _Expected(replies, "error")
        try:
            keys = proto.decode_keys(payload)
        except proto.ProtocolError:
            return _Expected(replies, "error")
        if header.type is proto.MessageType.LOOKUP:
            replies.append(("lookup", header.request_id, held_prefix(keys, held)))
        else:
            for i, key in enumerate(keys):
                rid = (header.request_id + i) % proto.REQUEST_ID_MOD
                replies.append(("chunk" if key in held else "missing", rid, key))


def _read_frames(conn: RawDataConnection, want: int, wait_close: bool, linger: float) -> tuple[list, str]:
    """Frames until ``want`` replies (and the close, if expected) or silence; returns (frames, end)."""
    frames: list[tuple[proto.Header, bytes]] = []
    end_time = time.monotonic() + REPLY_TIMEOUT
    while True:
        remaining = end_time - time.monotonic()
        if len(frames) >= want and not wait_close:
            conn.sock.settimeout(linger)
        else:
            conn.sock.settimeout(max(0.01, remaining))
        try:
            head = conn.read_exact(proto.HEADER_BYTES)
        except socket.timeout:
            if len(frames) >= want and not wait_close:
                return frames, "open"
            return frames, "timeout"
        except (ConnectionError, OSError):
            return frames, "closed"
        header = proto.decode_header(head)
        conn.sock.settimeout(REPLY_TIMEOUT)
        payload = conn.read_exact(header.length)
        frames.append((header, payload))
        if header.type is proto.MessageType.ERROR:
            wait_close = True


def _check_replies(frames: list[tuple[proto.Header, bytes]], expected: _Expected, chunk_bytes: int,
                   allow_truncated: bool) -> int:
    """Every reply is right and in order; returns how many of the expected replies came."""
    got = [f for f in frames if f[0].type is not proto.MessageType.ERROR]
    if len(got) > len(expected.replies) or (not allow_truncated and len(got) != len(expected.replies)):
        raise FuzzFailure(f"{len(got)} replies for {len(expected.replies)} expected")
    for (header, payload), (kind, rid, value) in zip(got, expected.replies):
        if header.request_id != rid:
            raise FuzzFailure(f"reply request id {header.request_id} != {rid}")
        if kind == "lookup":
            if header.type is not proto.MessageType.LOOKUP_REPLY or \
                    proto.decode_lookup_reply(payload, 1 << 20) != value:
                raise FuzzFailure(f"LOOKUP answered {header.type.name} {payload!r}, expected {value}")
        elif kind == "missing":
            if header.type is not proto.MessageType.CHUNK_MISSING or proto.decode_chunk_missing(payload) != value:
                raise FuzzFailure(f"expected CHUNK_MISSING for {value.hex()}, got {header.type.name}")
        else:
            if header.type is not proto.MessageType.CHUNK:
                raise FuzzFailure(f"expected CHUNK {value.hex()}, got {header.type.name}")
            prefix = proto.decode_chunk_prefix(payload)
            data = payload[prefix.size:]
            known = value.startswith(HELD_PREFIX)  # fuzz-committed chunks hold unknown bytes
            if prefix.key != value or len(data) != chunk_bytes or chunk_checksum(data) != prefix.checksum \
                    or (known and data != chunk_content(value, chunk_bytes)):
                raise FuzzFailure(f"CHUNK {value.hex()} arrived wrong")
    return len(got)


def run_data_case(ctx: FuzzContext, case: list) -> str:
    stream = b"".join(_frame_bytes(p) for p in case)
    chunk_bytes = ctx.pool.chunk_bytes
    expected = model_stream(stream, chunk_bytes, ctx.extra_held)
    with RawDataConnection(ctx.data_address, timeout=REPLY_TIMEOUT) as conn:
        conn.authenticate(ctx.session)
        conn.send(stream)
        wait_close = expected.ending in ("error", "close")
        frames, end = _read_frames(conn, len(expected.replies), wait_close,
                                   0.05 if expected.ending == "incomplete" else 0.01)
    errors = [f for f in frames if f[0].type is proto.MessageType.ERROR]
    if expected.ending == "error":
        if end != "closed" or not errors or frames[-1][0].type is not proto.MessageType.ERROR:
            raise FuzzFailure(f"a bad frame did not end in ERROR + close (end={end}, "
                              f"{[f[0].type.name for f in frames]})")
        _check_replies(frames, expected, chunk_bytes, allow_truncated=True)
        return "error"
    if errors:
        raise FuzzFailure(f"valid frames got an ERROR: {errors[0][1][:200]!r}")
    if end == "timeout":
        raise FuzzFailure(f"no answer within {REPLY_TIMEOUT}s ({len(frames)} of {len(expected.replies)})")
    _check_replies(frames, expected, chunk_bytes, allow_truncated=expected.ending == "close")
    if expected.ending == "close" and end != "closed":
        raise FuzzFailure("CLOSE did not close the connection")
    return "incomplete" if expected.ending == "incomplete" else "answer"


def run_preauth_case(ctx: FuzzContext, case: bytes) -> str:
    with RawDataConnection(ctx.data_address, timeout=REPLY_TIMEOUT) as conn:
        conn.read_challenge()
        conn.send(case)
        complete = _first_frame_complete(case, ctx.pool.chunk_bytes)
        frames, end = _read_frames(conn, 0, complete, 0.05)
    for header, _ in frames:
        if header.type is not proto.MessageType.ERROR:
            raise FuzzFailure(f"before authentication the server sent {header.type.name}")
    if complete:
        if end != "closed" or not frames:
            raise FuzzFailure(f"a complete unauthenticated frame got no ERROR + close ({end})")
        return "error"
    return "incomplete"


def _first_frame_complete(stream: bytes, chunk_bytes: int) -> bool:
    """True when the server has enough bytes to judge the first frame."""
    if len(stream) < proto.HEADER_BYTES:
        return False
    try:
        header = proto.decode_header(stream[:proto.HEADER_BYTES], chunk_bytes)
    except proto.ProtocolError:
        return True
    if header.type is proto.MessageType.CHUNK:
        return True
    return len(stream) - proto.HEADER_BYTES >= header.length


@dataclass(frozen=True)
class FuzzTarget:
    """One kind of message: its cases and how to send and judge one."""

    # Name in the report.
    name: str
    # Hypothesis strategy of one case.
    strategy: Any
    # Sends one case; returns "answer", "error" or "incomplete"; raises FuzzFailure.
    run: Callable[[FuzzContext, Any], str]
    # Share of the run's cases.
    weight: float


TARGETS = (
    FuzzTarget("handshake", handshake_cases(), run_handshake_case, 0.2),
    FuzzTarget("summary", summary_cases, run_summary_case, 0.08),
    FuzzTarget("lookup", lookup_cases, run_lookup_case, 0.17),
    FuzzTarget("local", local_cases, run_local_case, 0.2),
    FuzzTarget("data_preauth", preauth_streams, run_preauth_case, 0.12),
    FuzzTarget("data_frames", data_streams, run_data_case, 0.23),
)


# ---------------------------------------------------------------- the run


def start_fuzz_sidecar(pool: ChaosPool) -> FuzzContext:
    """Start the sidecar under test, give it the held chunks and a peer session."""
    sc = pool.add("fuzzed")
    engine = sc.engine()
    try:
        keys = held_keys()

        def write(i: int, view: memoryview) -> None:
            view[:] = chunk_content(keys[i], pool.chunk_bytes)

        if engine.store(keys, write) != len(keys):
            raise RuntimeError("could not store the fuzz pool's held chunks")
        socket_path = engine.socket_path
        num_slots = engine.num_slots
    finally:
        engine.close()
    status = sc.status()
    probe = probe_handshake(sc.control_address, pool.pool_key, pool.local_hello(identity="fuzz-peer"))
    return FuzzContext(pool, sc, Http(sc.control_address), socket_path, status["data_address"],
                       probe.session, num_slots)


def check_alive(ctx: FuzzContext, result: FuzzResult) -> None:
    """The process runs and answers /healthz in time; raises FuzzFailure otherwise."""
    if not ctx.sidecar.alive:
        result.crashes += 1
        raise FuzzFailure(f"the sidecar died: {ctx.sidecar.log_tail()}")
    probe = Http(ctx.sidecar.control_address)
    try:
        status, _ = probe.request("GET", "/healthz")
    except OSError as exc:
        result.hangs += 1
        raise FuzzFailure(f"/healthz did not answer: {exc}") from None
    finally:
        probe.close()
    if status != 200:
        result.hangs += 1
        raise FuzzFailure(f"/healthz answered {status}")


def check_store_consistent(ctx: FuzzContext) -> None:
    """No reservation outlived its connection: slots in use == visible chunks."""
    for _ in range(50):
        store = ctx.sidecar.status()["store"]
        if store["used_bytes"] == store["chunks"] * store["slot_stride"]:
            return
        time.sleep(0.02)
    raise FuzzFailure(f"store has slots in use beyond its visible chunks: {store}")


def run_target(ctx: FuzzContext, target: FuzzTarget, examples: int, result: FuzzResult,
               *, seed: int | None = None, raise_failures: bool = True,
               progress: Callable[[str], None] | None = None) -> TargetStats:
    """Run ``examples`` hypothesis cases of one target against the live sidecar."""
    stats = TargetStats(target.name)
    result.targets.append(stats)
    started = time.monotonic()
    case_index = [0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink] if raise_failures else [Phase.generate],
              report_multiple_bugs=False)
    @given(target.strategy)
    def case(value: Any) -> None:
        stats.cases += 1
        case_index[0] += 1
        try:
            try:
                outcome = target.run(ctx, value)
            except FuzzFailure:
                raise
            except Exception as exc:  # a reset, a reply the decoders refuse, ...
                raise FuzzFailure(f"{target.name}: {type(exc).__name__}: {exc}") from exc
        except FuzzFailure as exc:
            stats.failures += 1
            if raise_failures:
                raise
            # The bench counts every failure and goes on; the first is kept for the report.
            stats.first_failure = stats.first_failure or f"{exc} (case {value!r})"[:600]
            return
        stats.answers += outcome == "answer"
        stats.errors += outcome == "error"
        stats.incomplete += outcome == "incomplete"
        if case_index[0] % 100 == 0:
            check_alive(ctx, result)
            rss = ctx.sidecar.rss_bytes()
            result.rss_peak_bytes = max(result.rss_peak_bytes, rss)
            result.rss_series.append((sum(t.cases for t in result.targets), rss))
        if progress and case_index[0] % 500 == 0:
            progress(f"fuzz {target.name}: {stats.cases} cases, {stats.failures} failures")

    try:
        case()
        check_alive(ctx, result)
        check_store_consistent(ctx)
    except Exception as exc:  # FuzzFailure, or hypothesis' own report of one (e.g. FlakyFailure)
        stats.first_failure = stats.first_failure or f"{type(exc).__name__}: {exc}"[:600]
        stats.failures = max(stats.failures, 1)
        if raise_failures:
            raise
    ctx.http.close()
    stats.seconds = round(time.monotonic() - started, 2)
    return stats


def run_fuzz(pool: ChaosPool, total_cases: int, *, rss_bound_bytes: int = DEFAULT_RSS_BOUND,
             progress: Callable[[str], None] | None = None, raise_failures: bool = False) -> FuzzResult:
    """Fuzz every target of a fresh sidecar of ``pool`` with about ``total_cases`` cases."""
    started = time.monotonic()
    result = FuzzResult(rss_bound_bytes=rss_bound_bytes)
    ctx = start_fuzz_sidecar(pool)
    warm = FuzzResult()
    for target in TARGETS:  # warm-up: import paths, caches, allocator arenas
        run_target(ctx, target, 20, warm, raise_failures=raise_failures)
    result.rss_start_bytes = result.rss_peak_bytes = ctx.sidecar.rss_bytes()
    for target in TARGETS:
        n = max(1, round(total_cases * target.weight))
        run_target(ctx, target, n, result, raise_failures=raise_failures, progress=progress)
    with contextlib.suppress(OSError):
        result.rss_end_bytes = ctx.sidecar.rss_bytes()
    result.rss_peak_bytes = max(result.rss_peak_bytes, result.rss_end_bytes)
    result.seconds = round(time.monotonic() - started, 2)
    return result
