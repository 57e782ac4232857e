"""Raw sockets on a data port, for tests that control every byte: a connection from any
127.x source address, whole frames, what came back until the server closed, its ERROR text,
and a connection authenticated with the test session of ``transport_peers``."""

from __future__ import annotations

import socket

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.data.tcp.sockets import split_host_port
from transport_peers import SESSION_ID, SESSION_KEY


def dial(address: str, source: str = "127.0.0.1") -> socket.socket:
    """A raw connection to the data port ``address`` (``tcp://host:port`` or any scheme) from
    ``source`` (any 127.x address works on loopback)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(split_host_port(address.split("://", 1)[1]))
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += part
    return out


def read_frame(sock: socket.socket) -> tuple[proto.Header, bytes]:
    header = proto.decode_header(recv_exact(sock, proto.HEADER_BYTES))
    return header, recv_exact(sock, header.length)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not part:
            return data
        data += part


def error_text(data: bytes) -> str:
    """The ERROR frame in ``data`` (the server's last words before closing)."""
    header = proto.decode_header(data[:proto.HEADER_BYTES])
    assert header.type is proto.MessageType.ERROR, header
    return proto.decode_error(data[proto.HEADER_BYTES:proto.HEADER_BYTES + header.length])


def authenticated(address: str, source: str = "127.0.0.1") -> socket.socket:
    """A connection that proved the test session (AUTH_OK read)."""
    sock = dial(address, source)
    header, nonce = read_frame(sock)
    assert header.type is proto.MessageType.AUTH_CHALLENGE
    sock.sendall(proto.join(proto.encode_auth_response(SESSION_ID, auth_proof(SESSION_KEY, nonce))))
    header, _ = read_frame(sock)
    assert header.type is proto.MessageType.AUTH_OK
    return sock
