"""One request on a fresh connection, and what came back, for ``kv-offload bench attack``.

``http_exchange`` (status and body, or "closed/reset without an answer", or no answer in
time), ``data_exchange`` (the data-plane frames, with the close or reset that ended
them), ``local_exchange`` (the local channel's reply frame, its size, and whether the
channel stayed open), ``data_authenticate`` (a member's session proving itself on a new
data connection). Targets are loopback only (``attack_sockets.connect``).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof

from kv_offload_tools.bench.attack.sockets import connect, describe, frame_names, http_status, split_address

# Seconds a one-shot exchange waits for the whole answer.
EXCHANGE_TIMEOUT = 5.0


@dataclass
class Answer:
    """What one request on a fresh connection got back."""

    # "HTTP 400", "AUTH_CHALLENGE+ERROR(unauthenticated)", "ok:false", "nothing", "refused" ...
    word: str
    # HTTP status (None for other ports or no status line).
    status: int | None = None
    # The answer's bytes (headers and body, or frames), at most 64 KiB.
    data: bytes = b""
    # True when the sidecar closed the connection within the exchange's time.
    closed: bool = False
    seconds: float = 0.0


def _recv_all(sock: socket.socket, deadline: float, enough=None, cap: int = 65536) -> tuple[bytes, str]:
    """Bytes until the peer closes ("closed"), resets ("reset"), ``enough(data)`` holds
    ("answered") or ``deadline`` passes ("timeout")."""
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(buf), "timeout"
        sock.settimeout(left)
        try:
            part = sock.recv(65536)
        except socket.timeout:
            return bytes(buf), "timeout"
        except OSError:
            return bytes(buf), "reset"
        if not part:
            return bytes(buf), "closed"
        if len(buf) < cap:
            buf += part[:cap - len(buf)]
        if enough is not None and enough(bytes(buf)):
            return bytes(buf), "answered"


def _silence(end: str) -> str:
    """The word for a connection that got no byte back."""
    return {"closed": "closed without an answer", "reset": "reset without an answer",
            "timeout": f"no answer in {EXCHANGE_TIMEOUT:g} s"}.get(end, "nothing")


def _http_complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return True
    return False


def _send_all(sock: socket.socket, payload: Sequence[bytes | memoryview] | bytes) -> None:
    """Send as much as the peer takes; a peer that answers and closes early is not an error."""
    for part in [payload] if isinstance(payload, (bytes, memoryview)) else payload:
        try:
            sock.sendall(part)
        except OSError:
            return


def http_request(method: str, path: str, body: bytes = b"",
                 headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """An HTTP/1.1 request (Connection: close) with ``headers`` after Host."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             *(f"{k}: {v}" for k, v in headers)]
    if body or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _dial(host: str, port: int, source: str) -> tuple[socket.socket | None, float, str]:
    """A connection from ``source``, the monotonic time dialling began, and (None, ...,
    "refused (...)") when it failed."""
    started = time.monotonic()
    try:
        return connect(host, port, source), started, ""
    except OSError as exc:
        return None, started, f"refused ({type(exc).__name__})"


def http_exchange(host: str, port: int, request: bytes, source: str,
                  timeout: float = EXCHANGE_TIMEOUT) -> Answer:
    """Send ``request`` on a fresh connection; the status and what came back."""
    sock, started, refused = _dial(host, port, source)
    if sock is None:
        return Answer(refused, seconds=time.monotonic() - started)
    with sock:
        sock.settimeout(timeout)
        _send_all(sock, request)
        data, end = _recv_all(sock, started + timeout, _http_complete)
    status = http_status(data)
    word = describe("http", data) if data else _silence(end)
    return Answer(word, status, data, end in ("closed", "reset"), time.monotonic() - started)


def data_exchange(address: str, payload: Sequence[bytes | memoryview] | bytes, source: str,
                  timeout: float = EXCHANGE_TIMEOUT) -> Answer:
    """Connect to a data port, send ``payload`` (the server's challenge is read with the rest)."""
    sock, started, refused = _dial(*split_address(address), source)
    if sock is None:
        return Answer(refused, seconds=time.monotonic() - started)
    with sock:
        _send_all(sock, payload)
        data, end = _recv_all(sock, started + timeout)
    closed = end in ("closed", "reset")
    word = (describe("data", data) + (f" + {'close' if end == 'closed' else 'reset'}" if closed else " (left open)")
            if data else _silence(end))
    return Answer(word, None, data, closed, time.monotonic() - started)


def local_exchange(path: str, payload: bytes, timeout: float = EXCHANGE_TIMEOUT) -> Answer:
    """Send raw bytes on the local channel (Unix socket); the reply frame, if any."""
    started = time.monotonic()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except OSError as exc:
            return Answer(f"refused ({type(exc).__name__})", seconds=time.monotonic() - started)
        _send_all(sock, payload)
        data, end = _recv_all(sock, started + timeout,
                              lambda d: len(d) >= 4 and len(d) >= 4 + struct.unpack("!I", d[:4])[0], 4 << 20)
        if end == "answered":  # the reply is whole: does the channel stay open or close?
            more, end = _recv_all(sock, time.monotonic() + 0.2)
            data += more
    closed = end in ("closed", "reset")
    if not data:
        return Answer(_silence(end), None, data, closed, time.monotonic() - started)
    word = "partial reply"
    if len(data) >= 4:
        try:
            reply = json.loads(data[4:4 + struct.unpack("!I", data[:4])[0]])
            word = "ok:false" if isinstance(reply, dict) and reply.get("ok") is False else "ok:true"
        except ValueError:
            word = "non-JSON reply"
    if len(data) > 4096:
        word += f" of {len(data) // 1024} KiB"
    word += " + close" if closed else " (left open)"
    return Answer(word, None, data, closed, time.monotonic() - started)


def data_authenticate(address: str, source: str, session_id: bytes, session_key: bytes,
                      timeout: float = EXCHANGE_TIMEOUT) -> str:
    """A member's new data connection from ``source``: "AUTH_OK in N ms", or what it got."""
    sock, started, refused = _dial(*split_address(address), source)
    if sock is None:
        return refused
    with sock:
        data, end = _recv_all(sock, started + timeout, lambda d: len(d) >= proto.HEADER_BYTES + proto.NONCE_BYTES)
        names = frame_names(data)
        if names[:1] != ["AUTH_CHALLENGE"]:
            return "+".join(names) or _silence(end)
        nonce = data[proto.HEADER_BYTES:proto.HEADER_BYTES + proto.NONCE_BYTES]
        _send_all(sock, b"".join(bytes(p) for p in proto.encode_auth_response(session_id,
                                                                              auth_proof(session_key, nonce))))
        rest, end = _recv_all(sock, time.monotonic() + timeout, lambda d: len(d) >= proto.HEADER_BYTES)
    ms = 1e3 * (time.monotonic() - started)
    names = frame_names(rest)
    return f"{'+'.join(names) or _silence(end)} in {ms:.0f} ms"
