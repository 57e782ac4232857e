"""Same-run references of `bench vllm`: one memcpy and one raw-TCP transfer of a prefix's bytes.

``memcpy_seconds``: ``numpy.copyto`` between two pre-faulted buffers of the
prefix's size (best of ``repeats``), what a copy of those bytes costs one core.
``raw_tcp_seconds``: the bytes sent by another process over loopback
(``sendall`` of 8 MiB pieces) and received with ``recv_into`` into one
pre-faulted buffer, connect to last byte (best of ``repeats``): the socket
limit a TCP data plane is held to.
``memcpy_loop``: ``numpy.copyto`` of a prefix's bytes repeated on a thread of
this process (the sidecars' core) while its block runs: what bare byte
movement beside the engine costs the engine's decoding through the memory bus
the cores share, the floor under any design that moves the bytes on this host.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

__all__ = ["memcpy_loop", "memcpy_seconds", "raw_tcp_seconds"]

# Bytes per send/recv call of the raw TCP reference.
_PIECE = 8 << 20

_SENDER = r"""
import socket, sys
port, size, piece = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = memoryview(bytearray(b"\x5a" * piece))
with socket.create_connection(("127.0.0.1", port)) as s:
    while True:
        if not s.recv(1):
            break
        left = size
        while left > 0:
            n = min(piece, left)
            s.sendall(buf[:n])
            left -= n
"""


def memcpy_seconds(size: int, repeats: int = 3) -> float:
    """Best wall time of ``numpy.copyto`` of ``size`` bytes between two pre-faulted buffers."""
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def raw_tcp_seconds(size: int, repeats: int = 3) -> float:
    """Best wall time of ``size`` bytes over loopback TCP from another process into one buffer."""
    dst = np.zeros(size, dtype=np.uint8)
    view = memoryview(dst)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(size), str(_PIECE)])
        try:
            conn, _ = listener.accept()
            with conn:
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    conn.sendall(b"g")
                    got = 0
                    while got < size:
                        n = conn.recv_into(view[got:], min(_PIECE, size - got))
                        if n == 0:
                            raise ConnectionError("raw TCP sender closed early")
                        got += n
                    best = min(best, time.perf_counter() - t0)
        finally:
            sender.wait(timeout=30)
    return best


@contextlib.contextmanager
def memcpy_loop(size: int, cores: set[int]) -> Iterator[None]:
    """While the block runs, repeat ``numpy.copyto`` of ``size`` bytes on another thread of
    this process, pinned to ``cores`` (the copy releases the GIL)."""
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    stop = threading.Event()

    def copy() -> None:
        os.sched_setaffinity(0, cores)
        while not stop.is_set():
            np.copyto(dst, src)

    thread = threading.Thread(target=copy, name="memcpy-loop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
