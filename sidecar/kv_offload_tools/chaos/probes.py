"""A peer driven by hand: the two-step handshake and raw data-plane frames.

- ``probe_handshake``: the control-plane handshake done with the runtime's own
  ``HandshakeInitiator``, giving a real ``Session`` or the sidecar's refusal;
  the bodies it sent are kept for replay attacks.
- ``RawDataConnection``: a blocking data-plane socket speaking ``protocol``
  frames, authenticated or not (for attacks and the fuzzer's oracles).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HandshakeInitiator,
    HelloMessage,
    Session,
)

from kv_offload_testing.sidecar_process import SidecarProcess


@dataclass(frozen=True)
class ProbeSession:
    """What a hand-driven handshake produced."""

    # The established session (id and key for data connections).
    session: Session
    # The sidecar's hello (its data address, identity).
    server_hello: HelloMessage
    # The two HTTP bodies sent (for replay attacks).
    sent: tuple[dict[str, Any], dict[str, Any]]


def probe_handshake(sidecar: SidecarProcess, pool_key: bytes, hello: HelloMessage,
                    timeout: float = 5.0) -> ProbeSession:
    """Both handshake steps against ``sidecar``; HandshakeError when refused either way."""
    initiator = HandshakeInitiator(pool_key, hello)
    step1 = initiator.step1()
    step2 = initiator.step2(_step(sidecar, 1, step1, timeout))
    server_hello, session = initiator.finish(_step(sidecar, 2, step2, timeout))
    return ProbeSession(session, server_hello, (step1, step2))


def _step(sidecar: SidecarProcess, n: int, body: dict[str, Any], timeout: float) -> Any:
    """POST one handshake step; its reply, or HandshakeError carrying the sidecar's reason."""
    status, reply = sidecar.post("/v1/handshake", body, timeout=timeout)
    if status != 200:
        reason = reply.get("reason", "malformed") if isinstance(reply, dict) else "malformed"
        raise HandshakeError(str(reason), f"step {n} refused with HTTP {status}: {reply!r}")
    return reply


class RawDataConnection:
    """A blocking socket to a data-plane port that reads and writes raw frames."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        rest = address.removeprefix("tcp://")
        host, _, port = rest.rpartition(":")
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        self.nonce = b""

    def read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            buf += part
        return bytes(buf)

    def read_frame(self) -> tuple[proto.Header, bytes]:
        """One frame (header + whole payload, CHUNK data included)."""
        header = proto.decode_header(self.read_exact(proto.HEADER_BYTES))
        return header, self.read_exact(header.length)

    def read_challenge(self) -> bytes:
        header, payload = self.read_frame()
        if header.type is not proto.MessageType.AUTH_CHALLENGE:
            raise ConnectionError(f"expected AUTH_CHALLENGE, got {header.type.name}")
        self.nonce = proto.decode_auth_challenge(payload)
        return self.nonce

    def authenticate(self, session: Session) -> None:
        """Answer the challenge with the session; ConnectionError unless AUTH_OK."""
        nonce = self.nonce or self.read_challenge()
        self.send(proto.encode_auth_response(session.session_id, auth_proof(session.session_key, nonce)))
        header, payload = self.read_frame()
        if header.type is not proto.MessageType.AUTH_OK:
            raise ConnectionError(f"authentication refused: {header.type.name} {payload[:200]!r}")

    def send(self, parts: Sequence[bytes | memoryview] | bytes) -> None:
        self.sock.sendall(parts if isinstance(parts, bytes) else b"".join(bytes(p) for p in parts))

    def read_until_closed(self, limit: int = 1 << 24) -> list[tuple[proto.Header | None, bytes]]:
        """Every frame until the server closes (or ``limit`` bytes); a bad frame ends the list."""
        frames: list[tuple[proto.Header | None, bytes]] = []
        total = 0
        while total < limit:
            try:
                head = self.read_exact(proto.HEADER_BYTES)
            except (ConnectionError, OSError):
                return frames
            try:
                header = proto.decode_header(head)
            except proto.ProtocolError:
                frames.append((None, head))
                return frames
            try:
                payload = self.read_exact(header.length)
            except (ConnectionError, OSError):
                frames.append((header, b""))
                return frames
            total += len(payload) + len(head)
            frames.append((header, payload))
        return frames

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> RawDataConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
