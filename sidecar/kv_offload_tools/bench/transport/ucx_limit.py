"""The ``ucx_sm_limit`` and ``ucx_sm_tagsend`` methods of ``kv-offload bench transport``:
bare ucxx, no transport.

What any data plane built on ucxx can reach on this machine while the receiver
verifies every chunk, measured beside the sidecar's own UCX transport so the
gap between them is overhead and the gap to raw TCP is the machine:

- two processes, ``UCX_TLS=sm,self``, tag messages between worker addresses;
- the fetcher has two workers like the transport's two lanes: ``put_zcopy`` (the
  holder's core copies) and ``get_zcopy`` (the fetcher's core copies), every third
  chunk on the second;
- both sides busy-poll UCX while a set moves (no asyncio, no protocol frames, no
  store bookkeeping, no deadlines), the holder sleeps in epoll between sets;
- the fetcher hashes each chunk (xxh3-64, as the transport does) as soon as it
  lands and compares it with the holder's checksum.

``ucx_sm_tagsend`` is the same with one lane (the holder copies every chunk) and no
hashing: plain UCX tag send/recv over CMA, the reference the UCX targets are set by.

Wire: the fetcher sends its two worker addresses (tags ``_TAG_LANE0``/``_TAG_LANE1``),
then per set a 24-byte request (set index, chunk count, lanes) on ``_TAG_REQUEST``;
the holder answers with the set's chunks, one message each, on ``_TAG_DATA + lane``.
A request with a negative count ends the holder's loop.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

# Chunks of a set on the fetcher-copied lane: every GET_LANE_EVERY-th, as the transport.
from kv_offload_sidecar.data.ucx.client import GET_LANE_EVERY

# Tags of the limit's messages.
_TAG_LANE0, _TAG_LANE1, _TAG_REQUEST, _TAG_DATA = 11, 12, 13, 100
# Milliseconds the idle holder waits in epoll before looking again.
_IDLE_WAIT_MS = 50
# UCX contexts of this process's workers (a worker must not outlive its context).
_contexts: list[Any] = []


def _ucx() -> tuple[Any, Any, Any, Any]:
    import ucxx  # noqa: F401  (loads libucx)
    from ucxx._lib import libucxx as api
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    return api, Array, Tag, TagMaskFull


def _worker(api: Any, config: dict[str, str]) -> Any:
    ctx = api.UCXContext(config, feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
    worker = api.UCXWorker(ctx, enable_delayed_submission=False, enable_python_future=False)
    worker.init_blocking_progress_mode()
    _contexts.append(ctx)
    return worker


def _endpoint(api: Any, worker: Any, address: bytes) -> Any:
    return api.UCXEndpoint.create_from_worker_address(
        worker, api.UCXAddress.create_from_buffer(address), False)


def _wait(worker: Any, requests: list[Any]) -> None:
    while not all(r.completed for r in requests):
        worker.progress_once()
    for r in requests:
        r.check_error()


def _recv_sized(worker: Any, tag: int, Array: Any, Tag: Any, mask: Any) -> bytes:
    """The next message on ``tag``, whatever its length (busy-polls until it is there)."""
    while True:
        probe = worker.tag_probe(Tag(tag), mask, remove=True)
        if probe.matched:
            break
        worker.progress_worker_event(_IDLE_WAIT_MS)
    buf = bytearray(max(probe.length, 1))
    req = worker.tag_recv_with_handle(Array(buf), probe)
    _wait(worker, [req])
    return bytes(buf[:probe.length])


def serve(views: list[memoryview], ready: threading.Event, address_out: list[bytes]) -> None:
    """The holder: answers requests for sets of ``views`` until a negative count (thread body)."""
    import numpy as np

    try:
        api, Array, Tag, mask = _ucx()
        worker = _worker(api, {})
        address_out.append(bytes(worker.address))
    finally:
        ready.set()
    lanes = [_endpoint(api, worker, _recv_sized(worker, t, Array, Tag, mask))
             for t in (_TAG_LANE0, _TAG_LANE1)]
    request = np.zeros(3, dtype=np.int64)
    sources = [np.frombuffer(v, dtype=np.uint8) for v in views]
    while True:
        req = worker.tag_recv(Array(request), Tag(_TAG_REQUEST), mask)
        while not req.completed:
            worker.progress_worker_event(_IDLE_WAIT_MS)
        req.check_error()
        s, n, two = int(request[0]), int(request[1]), int(request[2]) == 2
        if n < 0:
            return
        sends = []
        for i in range(n):
            lane = 1 if two and (i + 1) % GET_LANE_EVERY == 0 else 0
            sends.append(lanes[lane].tag_send(Array(sources[s * n + i]), Tag(_TAG_DATA + lane)))
        _wait(worker, sends)


def run_server(source_views: list[memoryview], commands: Any, emit: Any) -> None:
    """Serve ``source_views`` from a thread, print the address, return at the ``quit`` command."""
    from kv_offload_sidecar.data.ucx.frames import encode_address

    ready, address = threading.Event(), []  # type: ignore[var-annotated]
    thread = threading.Thread(target=serve, args=(source_views, ready, address), daemon=True)
    thread.start()
    if not ready.wait(60) or not address:
        raise RuntimeError("the UCX limit holder did not start (see its error above)")
    emit({"address": encode_address(address[0])})
    for _ in commands:
        pass


class UcxLimitFetcher:
    """The fetcher of the limit: two workers, busy-polled, each chunk hashed as it lands
    (``lanes=1, verify=False``: one worker, nothing hashed)."""

    def __init__(self, args: argparse.Namespace, size: int, n: int, expected: list[int], *,
                 lanes: int = 2, verify: bool = True) -> None:
        import numpy as np
        from kv_offload_sidecar.data.ucx.frames import decode_address
        from kv_offload_tools.bench.transport.nixl_methods import fetch_pool

        api, Array, Tag, mask = _ucx()
        self.np, self.Array, self.Tag, self.mask = np, Array, Tag, mask
        self.size, self.n, self.expected = size, n, expected
        self.lanes, self.verify = lanes, verify
        self.map, self.pool = fetch_pool(args.shm_dir, "bench-limit", size * n)
        self.slots = [self.pool[i * size:(i + 1) * size] for i in range(n)]
        self.workers = [_worker(api, {}), _worker(api, {"RNDV_SCHEME": "get_zcopy"})]
        holder = decode_address(args.address.split("|")[0])
        self.ep = _endpoint(api, self.workers[0], holder)
        _endpoint(api, self.workers[1], holder)  # wires the lane up with the holder
        _wait(self.workers[0], [self.ep.tag_send(Array(bytearray(w.address)), Tag(t))
                                for w, t in zip(self.workers, (_TAG_LANE0, _TAG_LANE1))])

    async def fetch_set(self, s: int) -> None:
        import xxhash

        np, Array, Tag, mask = self.np, self.Array, self.Tag, self.mask
        recvs = []
        for i in range(self.n):
            lane = 1 if self.lanes == 2 and (i + 1) % GET_LANE_EVERY == 0 else 0
            recvs.append((i, self.workers[lane].tag_recv(Array(self.slots[i]), Tag(_TAG_DATA + lane), mask)))
        _wait(self.workers[0], [self.ep.tag_send(Array(np.array([s, self.n, self.lanes], dtype=np.int64)),
                                                 Tag(_TAG_REQUEST))])
        ok = True
        w0, w1 = self.workers
        while recvs:
            w0.progress_once()
            w1.progress_once()
            still = []
            for i, r in recvs:
                if r.completed:
                    r.check_error()
                    if self.verify:
                        ok &= xxhash.xxh3_64_intdigest(self.slots[i]) == self.expected[s * self.n + i]
                else:
                    still.append((i, r))
            recvs = still
        if not ok:
            raise RuntimeError("a chunk failed its checksum on the UCX limit path")

    def digests(self, s: int) -> list[int]:
        import xxhash

        return [xxhash.xxh3_64_intdigest(v) for v in self.slots]

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        return [], []

    async def close(self) -> None:
        import numpy as np

        req = self.ep.tag_send(self.Array(np.array([0, -1, 0], dtype=np.int64)), self.Tag(_TAG_REQUEST))
        for _ in range(100_000):  # best effort: the holder also ends at the quit command
            if req.completed:
                break
            self.workers[0].progress_once()
