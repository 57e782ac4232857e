"""Raw TCP with N streams, pinned as `bench gpu`'s sidecars are: the limit a lane count is held to.

A sender process on the holder's CPUs and a receiver process on the fetcher's CPUs, one
loopback connection per stream, each stream a thread on both sides (``sendall`` of 4 MiB
pieces; ``recv_into`` its share of one pre-faulted shared mapping, as a sidecar lands chunks
in shared memory); the socket calls release the GIL, so the streams use as many cores as they
are given (``shared/gpu/host_limits.py`` measured the same with a process per stream). Pull
model, as a hit: the receiver asks every stream for its share (one byte each) and the time is
until the last byte landed. The fastest of ``repeats`` pulls after a warm-up (the limit: a hit's
median is held to the best the sockets did); the CPU-seconds of each process
(``/proc/<pid>/stat``) over the timed pulls, per GB.

Run as ``python -m kv_offload_tools.bench.gpu.raw_tcp recv|send ...`` by ``raw_tcp`` only.
"""

from __future__ import annotations

import json
import mmap
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from kv_offload_tools.bench.attack.pool import cpu_seconds
from kv_offload_tools.bench.gpu.pinning import started_on

# Bytes per send and per receive call.
PIECE = 4 << 20
_MODULE = "kv_offload_tools.bench.gpu.raw_tcp"


def _shares(total: int, streams: int) -> list[int]:
    base, extra = divmod(total, streams)
    return [base + (1 if i < extra else 0) for i in range(streams)]


def _receiver(streams: int, total: int) -> None:
    import numpy as np

    region = mmap.mmap(-1, total)
    np.frombuffer(region, dtype=np.uint8)[:] = 0  # fault the pages in
    view = memoryview(region)
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(streams)]
    print(json.dumps({"ports": [s.getsockname()[1] for s in listeners]}), flush=True)
    conns = [s.accept()[0] for s in listeners]
    shares = _shares(total, streams)
    starts = [sum(shares[:i]) for i in range(streams)]

    def pull(i: int) -> None:
        conns[i].sendall(b"g")
        got, end = 0, shares[i]
        while got < end:
            n = conns[i].recv_into(view[starts[i] + got:starts[i] + end], min(PIECE, end - got))
            if n == 0:
                raise ConnectionError("raw TCP sender closed early")
            got += n

    for line in sys.stdin:
        if line.strip() != "go":
            break
        threads = [threading.Thread(target=pull, args=(i,)) for i in range(streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    for c in conns:
        c.close()


def _sender(ports: Sequence[int], total: int) -> None:
    piece = memoryview(bytearray(b"\x5a" * PIECE))

    def serve(port: int, share: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            while s.recv(1):
                left = share
                while left > 0:
                    n = min(PIECE, left)
                    s.sendall(piece[:n])
                    left -= n

    threads = [threading.Thread(target=serve, args=(p, share))
               for p, share in zip(ports, _shares(total, len(ports)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def raw_tcp(streams: int, total: int, repeats: int, holder_cpus: Sequence[int],
            fetcher_cpus: Sequence[int]) -> dict[str, Any]:
    """Raw TCP with ``streams`` streams moving ``total`` bytes, sender on ``holder_cpus`` and
    receiver on ``fetcher_cpus``: its best rate and both sides' CPU-seconds per GB."""
    with started_on(fetcher_cpus):
        receiver = subprocess.Popen([sys.executable, "-m", _MODULE, "recv", str(streams), str(total)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sender = None
    try:
        assert receiver.stdin is not None and receiver.stdout is not None
        ports = json.loads(receiver.stdout.readline())["ports"]
        with started_on(holder_cpus):
            sender = subprocess.Popen([sys.executable, "-m", _MODULE, "send", str(total), *map(str, ports)])

        def pull() -> float:
            receiver.stdin.write("go\n")  # type: ignore[union-attr]
            receiver.stdin.flush()  # type: ignore[union-attr]
            line = receiver.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"the raw TCP receiver exited ({receiver.poll()})")
            return float(json.loads(line)["seconds"])

        pull()  # warm-up: connections, pages, buffers
        cpu0 = (cpu_seconds(sender.pid), cpu_seconds(receiver.pid))
        times = [pull() for _ in range(repeats)]
        cpu1 = (cpu_seconds(sender.pid), cpu_seconds(receiver.pid))
    finally:
        if receiver.stdin is not None:
            receiver.stdin.close()
        receiver.wait(30)
        if sender is not None:
            sender.wait(30)
    gb = total * repeats / 1e9
    return {"streams": streams, "bytes": total, "gbps": total / min(times) / 1e9,
            "runs_s": times, "sender_cpu_s_per_gb": (cpu1[0] - cpu0[0]) / gb,
            "receiver_cpu_s_per_gb": (cpu1[1] - cpu0[1]) / gb}


def main(argv: Sequence[str]) -> int:
    role, *rest = argv
    if role == "recv":
        _receiver(int(rest[0]), int(rest[1]))
    elif role == "send":
        _sender([int(p) for p in rest[1:]], int(rest[0]))
    else:
        raise SystemExit(f"usage: python -m {_MODULE} recv STREAMS BYTES | send BYTES PORT...")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
