"""What the fuzz targets know about the fuzzed sidecar, and how they judge an answer.

The sidecar holds ``HELD_COUNT`` chunks under keys starting ``HELD_PREFIX``
(plus whatever fuzzed local-channel cases committed); keys starting
``ABSENT_PREFIX`` are never stored, so the leading held keys of any list are
known without asking the sidecar.
"""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.engine.channel_protocol import MAX_TIMEOUT_SECONDS
from kv_offload_sidecar.peers.handshake import Session

from kv_offload_testing.local_pool import LocalPool
from kv_offload_testing.sidecar_process import SidecarProcess

# Prefix of the keys the fuzzed sidecar holds; fuzz-made keys never start with it.
HELD_PREFIX = b"\xaa\xaa\xaa\xaa"
# Prefix of keys known to be absent.
ABSENT_PREFIX = b"\xbb\xbb\xbb\xbb"
# Keys the fuzzed sidecar holds.
HELD_COUNT = 12
# Seconds a reply may take before the case counts as a hang.
REPLY_TIMEOUT = 5.0


class FuzzFailure(AssertionError):
    """A case got a wrong answer, a 5xx, no answer, or the sidecar died."""


def held_keys() -> list[bytes]:
    """The keys of the chunks the fuzzed sidecar is given before the first case."""
    return [HELD_PREFIX + i.to_bytes(4, "big") + bytes(12) for i in range(HELD_COUNT)]


def absent_key(i: int) -> bytes:
    """The ``i``-th key known to be absent."""
    return ABSENT_PREFIX + i.to_bytes(4, "big") + bytes(12)


def held_prefix(keys: list[bytes], extra: set[bytes] | frozenset[bytes] = frozenset()) -> int:
    """Leading keys the fuzzed sidecar holds (its held chunks plus fuzz-committed ones)."""
    held = set(held_keys())
    n = 0
    while n < len(keys) and (keys[n] in held or keys[n] in extra):
        n += 1
    return n


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


def expect_json_error(status: int, data: bytes, what: str) -> None:
    """A 4xx with a JSON body carrying a non-empty 'error' string."""
    if not 400 <= status < 500:
        raise FuzzFailure(f"{what}: HTTP {status} instead of a 4xx: {data[:200]!r}")
    try:
        body = json.loads(data)
    except ValueError:
        raise FuzzFailure(f"{what}: HTTP {status} body is not JSON: {data[:200]!r}") from None
    if not isinstance(body, dict) or not isinstance(body.get("error"), str) or not body["error"]:
        raise FuzzFailure(f"{what}: HTTP {status} without an 'error' message: {body!r}")


@dataclass
class FuzzContext:
    """The live sidecar under fuzzing and what the oracles know about it."""

    # The pool (config, key) of the sidecar.
    pool: LocalPool
    # The sidecar process.
    sidecar: SidecarProcess
    # Keep-alive HTTP client to its control port.
    http: Http
    # Path of its local channel socket.
    socket_path: str
    # Its data-plane address.
    data_address: str
    # An authenticated session of a hand-driven peer (for data frames).
    session: Session
    # Slots of its store.
    num_slots: int
    # The 401 body of a lookup without the admin token (every such lookup must get exactly it).
    unauthenticated_lookup_answer: Any = None
    # Client nonces that got a 200 on step 1 -> when (a reuse within the server's
    # replay window must be refused as a replay).
    seen_nonces: dict[str, float] = field(default_factory=dict)
    # Keys committed by fuzzed local-channel cases (bytes unknown, checksum must hold).
    extra_held: set[bytes] = field(default_factory=set)


def valid_keys(value: Any, max_keys: int) -> list[bytes] | None:
    """The keys of a request field as the sidecar must read them; None when it must refuse them."""
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


def valid_timeout(value: Any, present: bool) -> bool:
    """Whether the sidecar must accept a request's ``timeout`` field."""
    if not present:
        return True
    if value is None:
        return True  # control.parse_timeout: null means the default
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and 0 < value <= MAX_TIMEOUT_SECONDS)
