"""The UCX data plane: ``ucxx`` tag messages between worker addresses.

Why this shape (measured on a CPU-only host, see the README's Performance part):
UCX's shared-memory transports (``UCX_TLS=sm``, CMA rendezvous) only work with
peer error handling off, and ucxx's listener (sockaddr) path refuses them, so
endpoints are made from *worker addresses* exchanged out of band: the server's
address is what ``start()`` returns (``ucx://<base64 worker address>``), advertised
in the control-plane handshake; the client sends its own in ``UCX_ATTACH``.
Progress runs in ``blocking`` mode on the asyncio loop (the default progress
thread costs 2-3x on 2 cores). Call ``configure_ucx_env`` before ``ucxx`` is
imported (UCX reads its environment once).

Tags (64 bits): the high 32 bits are the connection id the client picked, the
low 32 bits say what travels: 0 client->server frames, 1 server->client frames,
``0x80000000 | request id`` the bytes of one chunk. ``ATTACH_TAG`` is the server's
attach tag. UCX matches tags per worker, not per endpoint, so the
connection id is how the server tells its clients apart; it is only used after
the client proved its session (the attach MAC, then the nonce challenge).
Control frames are received with ``tag_probe`` first, so their exact length is
known (UCX itself reports no received length) and a short, long or oversized
frame is refused as such.

A FETCH is answered in batches (as many chunks as the server's send window admits,
usually the whole FETCH): one server->client message carrying the batch's CHUNK
frames back to back (header + key + checksum each, the header's length still
counting the chunk bytes), then each chunk's bytes alone on the chunk's tag, sent
from the pinned slot straight into the reserved slot. The client posts those
receives *before* it sends the FETCH, so the bytes never wait in UCX's unexpected
queue; a key the server lacks gets a CHUNK_MISSING frame in the batch plus a 1-byte
message that completes the posted receive. One reply message per batch rather than
per chunk, and send completions handled by callbacks rather than a task per chunk,
took two lanes at 2 MiB from ~3.4 to ~4.2 GB/s.

Limits: one UCX server and one asyncio loop per process (ucxx keeps one global
worker bound to the loop that first used it). Without peer error handling a dead
peer is noticed by deadlines only: every wait here has one, and a connection that
misses one is aborted (its posted receives are cancelled) before any reservation
is released. Known gap: over ``sm`` large messages move by CMA
(``process_vm_writev``), and UCX treats a CMA copy into a process that died as
fatal when error handling is off. With ``UCX_RNDV_SCHEME=put_zcopy`` the holder
does the copy, so a *fetcher* survives a holder killed mid-transfer (tested, one
lane), but a *holder* whose fetcher is killed in the middle of a transfer is aborted
by UCX (and with two lanes so can the fetcher, whose lane reads by CMA).
The TCP transport has no such gap; isolating UCX in a helper process is the fix.
Error handling cannot close it either: with UCX 1.21 an endpoint with peer error
handling (even with ``UCX_MM_ERROR_HANDLING=y``) gets only ``sysv`` for tags, no
CMA, about 0.05 GB/s on the benchmark host.

Speed (``kv-offload bench transport``): with one lane (the default) a chunk moves
by one CMA copy in the holder (``put_zcopy``, 16 MiB segments), about 3.5-4 GB/s per
core on the benchmark host, so the holder's core is the limit; the fetcher keeps
``UCX_WINDOW`` chunks in flight and verifies chunk i while the holder copies the next
ones. With two lanes (``configure_ucx_env(lanes=2)``, ``--ucx-lanes 2``) the client
opens a second connection from a ``get_zcopy`` worker and sends every
``GET_LANE_EVERY``-th chunk over it, so the fetcher's core copies those while the
holder copies the rest; a progress pass then stops after ``PROGRESS_BUDGET`` so one
lane's copies do not starve the other lane's requests or the verification. The price:
a holder killed mid-transfer can abort the fetcher too (the kill test saw it in 2 of
14 runs), hence off by default.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import protocol as proto
from .base import (
    DEFAULT_AUTH_TIMEOUT,
    DEFAULT_SEND_TIMEOUT,
    Authorize,
    DataPlaneServer,
    PeerDataClient,
    PendingChunk,
    StoreLike,
    TransportError,
    answer_lookup,
    auth_proof,
    check_auth,
    commit_received,
    count_protocol_error,
    make_nonce,
    run_fetch,
    wait_until_idle,
)

if TYPE_CHECKING:
    from ..metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Tag of UCX_ATTACH messages ("KO" .. "ATTC"); its low half is no connection's tag kind.
ATTACH_TAG = 0x4B4F_0000_4154_5443
# Low tag bits: client -> server frames.
TAG_C2S = 0
# Low tag bits: server -> client frames.
TAG_S2C = 1
# Low tag bit marking a chunk's bytes; the other 31 bits are its request id.
TAG_DATA = 0x8000_0000
# Request ids of UCX clients wrap at 2**31 (they are part of a data tag).
UCX_REQUEST_ID_MOD = 1 << 31
# Receive buffer of one control frame (header + the largest control payload).
CONTROL_BUFFER_BYTES = proto.HEADER_BYTES + proto.MAX_CONTROL_PAYLOAD
# Receive buffer of UCX_ATTACH messages.
ATTACH_BUFFER_BYTES = (proto.HEADER_BYTES + 4 + 2 + proto.MAX_SESSION_ID_BYTES + proto.PROOF_BYTES
                       + proto.MAX_WORKER_ADDRESS_BYTES)
# Connections one server accepts at a time.
MAX_SERVER_CONNECTIONS = 1024
# Chunk sends one server connection keeps in flight.
SERVER_SENDS_IN_FLIGHT = 64
# Chunks a UCX client keeps in flight per fetch by default (UCX moves a chunk while the
# fetcher verifies the previous ones; deeper than TCP's window because every chunk waits
# for a rendezvous round trip between the two processes).
UCX_WINDOW = 32
# Seconds without a request or send after which a stopping server closes a connection.
IDLE_CLOSE_SECONDS = 0.25

# UCX transports when nothing else is configured: shared memory to same-host peers, TCP across nodes.
DEFAULT_TLS = "sm,tcp,self"
# UCX settings configure_ucx_env writes, besides UCX_TLS.
_UCX_DEFAULTS = {
    # Only for code that uses ucxx's own asyncio layer; this transport drives the worker itself.
    "UCXPY_PROGRESS_MODE": "blocking",
    # UCX over TCP assumes a slow link and uses 8 KiB segments; 1 MiB is 2-4x faster.
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    # A CMA (sm) rendezvous copies in segments of this size, one per progress call; the
    # default 512 KiB costs 5-10% at 2-16 MiB chunks.
    "UCX_CMA_SEG_SIZE": "16m",
    # ucxx sets UCX_MEMTYPE_CACHE which this UCX build does not know; keep logs quiet.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

# UCX settings of the second (fetch) lane's context: its chunks are copied by the *fetcher*.
GET_LANE_CONFIG = {"RNDV_SCHEME": "get_zcopy"}
# Lanes a UCX client uses per peer when nothing else is configured (see configure_ucx_env).
DEFAULT_LANES = 1
# With two lanes, every GET_LANE_EVERY-th chunk of a fetch takes the fetcher-copied lane: the
# fetcher's core also verifies every chunk, so it takes the smaller share of the copying.
GET_LANE_EVERY = 3

_state: dict[str, Any] = {"runtime": None, "lane": None, "server": None, "lanes": DEFAULT_LANES}


def configure_ucx_env(tls: str = DEFAULT_TLS, *, net_devices: str | None = None,
                      rndv_scheme: str = "put_zcopy", lanes: int = DEFAULT_LANES,
                      override: bool = True) -> dict[str, str]:
    """Set UCX's environment for this process; must run before ``ucxx`` is imported.

    ``tls``: ``"sm,self"`` (same host, shared memory), ``"tcp,self"``, or the
    default ``"sm,tcp,self"`` (UCX picks shared memory for a peer on the same host,
    TCP for one on another node);
    ``net_devices``: e.g. ``"lo"`` for loopback tests. ``rndv_scheme``: how large
    messages move; ``put_zcopy`` (the holder writes into the fetcher's slot) keeps
    the *fetching* process alive when the holder dies mid-transfer, which
    ``get_zcopy`` (the fetcher reads the holder's memory, slightly faster) does not:
    without peer error handling UCX aborts a process whose CMA copy hits a dead
    peer. ``lanes``: UCX connections a client opens per peer: 1 (the holder copies
    every chunk) or 2 (a second worker with ``get_zcopy`` rendezvous carries every
    ``GET_LANE_EVERY``-th chunk, copied by the fetcher, so both processes' cores copy;
    about 1.1-1.4x the bandwidth of one lane between same-host peers, at the price that
    a holder killed mid-transfer can abort the fetcher too). With ``override=False``
    variables already set in the environment win. Returns the values in effect.
    Raises RuntimeError when ucxx is already imported with other settings, and
    ValueError for another lane count.
    """
    if lanes not in (1, 2):
        raise ValueError(f"UCX lanes={lanes!r} is not supported; use 1 (holder copies) or 2 "
                         "(holder and fetcher copy)")
    wanted = dict(_UCX_DEFAULTS, UCX_TLS=tls, UCX_RNDV_SCHEME=rndv_scheme)
    if net_devices:
        wanted["UCX_NET_DEVICES"] = net_devices
    if "ucxx" in sys.modules:
        differ = [f"{k}={os.environ.get(k)!r} (wanted {v!r})" for k, v in wanted.items()
                  if os.environ.get(k) != v and (override or k not in os.environ)]
        if differ:
            raise RuntimeError("ucxx is already imported, so UCX settings can no longer change: "
                               + ", ".join(differ) + "; call configure_ucx_env() first thing")
        _state["lanes"] = lanes
        return {k: os.environ[k] for k in wanted}
    for key, value in wanted.items():
        if override or key not in os.environ:
            os.environ[key] = value
    _state["lanes"] = lanes
    return {k: os.environ[k] for k in wanted}


def configured_lanes() -> int:
    """UCX lanes new clients of this process open per peer (see configure_ucx_env)."""
    return int(_state["lanes"])


class UcxRuntime:
    """This process's UCX worker, progressed from the asyncio loop without busy waiting.

    ucxx's own asyncio layer waits on requests by polling them every loop
    iteration (100% CPU while anything is posted, and slow when a progress task
    is starved), so the transport drives the worker itself: progress until idle,
    complete the futures of finished requests, keep polling (once per loop
    iteration, so woken tasks run in between) for ``SPIN_SECONDS`` after a
    completion so round trips stay short, then ``arm`` the worker and sleep
    until its epoll descriptor fires. A slow timer guards against a
    missed wake-up.
    """

    # Seconds to keep progressing after a completion before arming the worker.
    SPIN_SECONDS = 50e-6
    # Seconds one pass may keep progressing (a call can copy a whole chunk) before the loop
    # runs the tasks it woke, when the copies compete with other work (see _shared).
    PROGRESS_BUDGET = 250e-6
    # Seconds between safety progress calls while requests are pending.
    SAFETY_SECONDS = 0.1
    # Nanoseconds an endpoint close may wait to cancel its requests.
    CLOSE_PERIOD_NS = 100_000_000

    def __init__(self, loop: asyncio.AbstractEventLoop, config: dict[str, str] | None = None) -> None:
        if "ucxx" not in sys.modules:
            configure_ucx_env(os.environ.get("UCX_TLS", DEFAULT_TLS), lanes=_state["lanes"],
                              override=False)
        import ucxx  # noqa: F401  (loads libucx and sets ucxx's env defaults)
        from ucxx._lib import libucxx as api
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self._api, self._Array, self._Tag, self._mask = api, Array, Tag, TagMaskFull
        self.loop = loop
        self._is_lane = bool(config)
        self.context = api.UCXContext(dict(config or {}),
                                      feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
        self.worker = api.UCXWorker(self.context, enable_delayed_submission=False,
                                    enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self.address = bytes(self.worker.address)
        # Posted requests: (request, its future, the buffer it uses, kept alive until done).
        self._pending: list[tuple[Any, asyncio.Future[None], Any]] = []
        self._probes: list[tuple[int, asyncio.Future[Any]]] = []
        self._scheduled = False
        self._posted = False  # a request or probe was added since the last progress pass
        self._hot_until = 0.0
        self._timer: asyncio.TimerHandle | None = None
        loop.add_reader(self.worker.epoll_file_descriptor, self._on_wakeup)

    @classmethod
    def get(cls) -> UcxRuntime:
        """The process's runtime, created on the running loop at first use."""
        loop = asyncio.get_running_loop()
        rt = _state["runtime"]
        if rt is None:
            rt = _state["runtime"] = cls(loop)
        elif rt.loop is not loop:
            raise RuntimeError("the UCX transport is bound to the first asyncio loop that used it; "
                               "run one event loop per process")
        return rt

    @classmethod
    def get_lane(cls) -> UcxRuntime:
        """The process's second worker, in its own UCX context with ``get_zcopy``
        rendezvous (``GET_LANE_CONFIG``): a chunk received on it is copied by this
        process (a CMA read), while the main worker's ``put_zcopy`` chunks are copied
        by the holder, so a two-lane fetch keeps both processes' cores copying."""
        main = cls.get()
        rt = _state["lane"]
        if rt is None:
            rt = _state["lane"] = cls(main.loop, GET_LANE_CONFIG)
        return rt

    def endpoint(self, worker_address: bytes) -> Any:
        """An endpoint to ``worker_address`` with peer error handling off (so sm works)."""
        address = self._api.UCXAddress.create_from_buffer(worker_address)
        return self._api.UCXEndpoint.create_from_worker_address(self.worker, address, False)

    def post_send(self, ep: Any, buf: Any, tag: int) -> asyncio.Future[None]:
        """Tag-send ``buf`` now (not copied; kept alive until done); the future completes with it."""
        array = self._Array(buf)
        return self._wait(ep.tag_send(array, self._Tag(tag)), array)

    def post_recv(self, ep: Any | None, buf: Any, tag: int) -> asyncio.Future[None]:
        """Post a receive of the next message tagged ``tag`` into ``buf`` now (on the worker
        when ep is None); the future completes when the bytes are in ``buf``."""
        src = self.worker if ep is None else ep
        array = self._Array(buf)
        return self._wait(src.tag_recv(array, self._Tag(tag), self._mask), array)

    async def send(self, ep: Any, buf: Any, tag: int) -> None:
        """Tag-send ``buf`` and wait for completion."""
        await self.post_send(ep, buf, tag)

    async def recv(self, ep: Any | None, buf: Any, tag: int) -> None:
        """Receive the next message tagged ``tag`` into ``buf``."""
        await self.post_recv(ep, buf, tag)

    async def recv_frame(self, tag: int, limit: int) -> bytearray:
        """Receive the next message tagged ``tag`` as a buffer of exactly its length.

        The message is found with ``tag_probe`` (UCX tells its length, so a short
        or long frame is seen as such) and received into a fresh buffer. A message
        over ``limit`` bytes is consumed and refused with ``ProtocolError('oversize')``.
        """
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._probes.append((tag, fut))
        self._posted = True  # the message may already be queued
        self._kick()
        probe = await fut
        n = probe.length
        buf = bytearray(min(n, limit) or 1)
        try:
            array = self._Array(buf)
            await self._wait(self.worker.tag_recv_with_handle(array, probe), array)
        except Exception as exc:
            if n > limit or _is_truncated(exc):
                raise proto.ProtocolError("oversize", f"frame of {n} bytes exceeds {limit}") from exc
            raise
        if n > limit:
            raise proto.ProtocolError("oversize", f"frame of {n} bytes exceeds {limit}")
        return buf if n else bytearray()

    def abort(self, ep: Any, *, wait: bool = True) -> None:
        """Close ``ep``; with ``wait`` (whenever receives into slots may be posted)
        block until its posted receives and sends are cancelled."""
        try:
            if wait:
                ep.close_blocking(period=self.CLOSE_PERIOD_NS, max_attempts=1)
            else:
                ep.close()
        except Exception as exc:
            log.debug("UCX endpoint close: %s", exc)
        self._kick()

    def _wait(self, req: Any, keep: Any = None) -> asyncio.Future[None]:
        fut = self.loop.create_future()
        if req.completed:  # e.g. a small (eager) send, or a receive of a message already here
            _resolve(req, fut)
            self._hot_until = time.perf_counter() + self.SPIN_SECONDS  # an answer may follow
            self._kick()
            return fut
        self._pending.append((req, fut, keep))
        self._posted = True
        self._kick()
        return fut

    def _shared(self) -> bool:
        """True when this worker's copies must leave room for other work: it is the
        fetcher-copied lane (verification and the holder-copied lane wait on this loop),
        this process fetches over two lanes, or its server feeds more than one connection
        (each needs its next sends posted). One connection alone progresses until idle,
        which moves its chunks fastest."""
        server = _state["server"]
        return (self._is_lane or _state["lane"] is not None
                or (server is not None and len(server._conns) > 1))

    def _on_wakeup(self) -> None:
        """The worker's event descriptor fired: progress now, not one loop pass later (on a
        round trip each side saves a pass), unless a pass is already queued."""
        if not self._scheduled:
            self._progress()

    def _kick(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._progress)

    def _progress(self) -> None:
        self._scheduled = False
        worker = self.worker
        events = self._posted  # a request may complete inside its own submission
        self._posted = False
        more = False
        shared = self._shared()
        start = time.perf_counter()
        while worker.progress_once():
            events = True
            if shared and time.perf_counter() - start > self.PROGRESS_BUDGET:
                more = True  # progress left undone: come back after the woken tasks ran
                break
        now = time.perf_counter()
        if self._probes and events:
            waiting = []
            for tag, fut in self._probes:
                if fut.done():
                    continue
                probe = worker.tag_probe(self._Tag(tag), self._mask, remove=True)
                if probe.matched:
                    fut.set_result(probe)
                    self._hot_until = now + self.SPIN_SECONDS
                else:
                    waiting.append((tag, fut))
            self._probes = waiting
        if events and self._pending:
            still = []
            for entry in self._pending:
                req, fut, _ = entry
                if not req.completed:
                    still.append(entry)
                elif not fut.done():
                    _resolve(req, fut)
            if len(still) != len(self._pending):
                self._pending = still
                self._hot_until = now + self.SPIN_SECONDS
        busy = self._pending or self._probes
        if more or (busy and now < self._hot_until):
            self._kick()  # keep polling for a moment, letting the woken tasks run in between
        elif not worker.arm():
            self._kick()  # events arrived meanwhile: progress again first
        elif busy and self._timer is None:
            self._timer = self.loop.call_later(self.SAFETY_SECONDS, self._safety)

    def _safety(self) -> None:
        self._timer = None
        self._posted = True  # look at everything once
        self._kick()


def _resolve(req: Any, fut: asyncio.Future[None]) -> None:
    """Complete ``fut`` with the outcome of the finished UCX request ``req``."""
    try:
        req.check_error()
    except Exception as exc:
        fut.set_exception(exc)
        fut.exception()  # a waiter that gave up must not log "never retrieved"
    else:
        fut.set_result(None)


def _tag(connection_id: int, low: int) -> int:
    return (connection_id << 32) | low


def _data_tag(connection_id: int, request_id: int) -> int:
    return _tag(connection_id, TAG_DATA | (request_id % UCX_REQUEST_ID_MOD))


def _buf(parts: list) -> bytearray:
    """A control frame as one contiguous message."""
    return bytearray(proto.join(parts))


def encode_address(worker_address: bytes) -> str:
    """``ucx://<base64 worker address>``."""
    return "ucx://" + base64.urlsafe_b64encode(worker_address).decode("ascii")


def decode_address(address: str) -> bytes:
    """The worker address inside ``ucx://...``; ValueError when it is not one."""
    rest = address.removeprefix("ucx://")
    try:
        raw = base64.urlsafe_b64decode(rest.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"UCX data address {address[:40]!r}... is not ucx://<base64>") from exc
    if not raw or len(raw) > proto.MAX_WORKER_ADDRESS_BYTES:
        raise ValueError(f"UCX data address carries {len(raw)} bytes; expected a worker address")
    return raw


def attach_mac(session_key: bytes, connection_id: int, worker_address: bytes) -> bytes:
    """MAC of a UCX_ATTACH message."""
    return hmac.new(session_key, proto.ucx_attach_signed_bytes(connection_id, worker_address),
                    hashlib.sha256).digest()


def _parse_frame(buf: bytearray, chunk_bytes: int | None) -> tuple[proto.Header, memoryview]:
    """Validate one received message: header, then a payload of exactly the announced size.

    A CHUNK message carries only the prefix (key + checksum); its header's length
    still counts the chunk bytes, which follow as their own message.
    """
    if len(buf) < proto.HEADER_BYTES:
        raise proto.ProtocolError("malformed", f"message of {len(buf)} bytes is shorter than a header")
    header = proto.decode_header(memoryview(buf)[:proto.HEADER_BYTES], chunk_bytes)
    payload = memoryview(buf)[proto.HEADER_BYTES:]
    if header.type is proto.MessageType.CHUNK:
        prefix = proto.decode_chunk_prefix(payload)
        if prefix.size != len(payload):
            raise proto.ProtocolError("malformed", f"CHUNK message carries {len(payload)} bytes "
                                      f"after its header, its prefix is {prefix.size}")
    elif len(payload) != header.length:
        raise proto.ProtocolError("malformed", f"{header.type.name} message carries {len(payload)} "
                                  f"payload bytes, its header says {header.length}")
    return header, payload


def _split_frames(buf: bytearray) -> list[tuple[proto.Header, memoryview]]:
    """The frames of one server->client message, back to back (a batch of CHUNK and
    CHUNK_MISSING frames answering a FETCH, or one frame). A CHUNK frame carries its
    prefix only (its bytes follow on their own tag); any other frame exactly the
    payload its header announces. A frame cut short is refused as malformed."""
    mv = memoryview(buf)
    if len(mv) < proto.HEADER_BYTES:
        raise proto.ProtocolError("malformed", f"message of {len(mv)} bytes is shorter than a header")
    frames = []
    pos = 0
    while pos < len(mv):
        if len(mv) - pos < proto.HEADER_BYTES:
            raise proto.ProtocolError("malformed", f"{len(mv) - pos} bytes after the last frame of a "
                                      "message are shorter than a header")
        header = proto.decode_header(mv[pos:pos + proto.HEADER_BYTES], None)
        body = mv[pos + proto.HEADER_BYTES:]
        if header.type is proto.MessageType.CHUNK:
            size = proto.decode_chunk_prefix(body).size
        else:
            size = header.length
            if size > len(body):
                raise proto.ProtocolError("malformed", f"{header.type.name} frame announces {size} "
                                          f"payload bytes, the message holds {len(body)}")
        frames.append((header, body[:size]))
        pos += proto.HEADER_BYTES + size
    return frames


def _is_truncated(exc: BaseException) -> bool:
    return "Truncated" in type(exc).__name__


class UcxDataPlaneServer(DataPlaneServer):
    """Serves chunks from ``store`` over UCX tag messages (one per process)."""

    def __init__(
        self,
        store: StoreLike,
        authorize: Authorize,
        metrics: SidecarMetrics | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int,
        auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        if chunk_bytes != store.slot_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} differs from the store's slot_bytes="
                             f"{store.slot_bytes}; pass the pool's kv_bytes_per_chunk to both")
        del host, port  # UCX endpoints come from worker addresses, not a port
        self._store = store
        self._authorize = authorize
        self._metrics = metrics
        self._chunk_bytes = chunk_bytes
        self._auth_timeout = auth_timeout
        self._send_timeout = send_timeout
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: dict[int, asyncio.Task[None]] = {}
        self._connections: dict[int, _ServerConnection] = {}
        self.address = ""

    async def start(self) -> str:
        """Initialise UCX and return ``ucx://<base64 worker address>``."""
        rt = UcxRuntime.get()
        if _state["server"] is not None:
            raise RuntimeError("a UCX data-plane server already runs in this process; "
                               "start one per sidecar process")
        _state["server"] = self
        self.address = encode_address(rt.address)
        self._accept_task = asyncio.create_task(self._accept_loop(rt), name="ucx-data-accept")
        return self.address

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop accepting at once; keep serving open connections until each has been idle
        ``IDLE_CLOSE_SECONDS`` or ``grace_seconds`` pass, then abort them."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(BaseException):
                await self._accept_task
        await wait_until_idle(self._conns, self._connections, grace_seconds)
        still = list(self._conns.values())
        for t in still:
            t.cancel()
        if still:
            await asyncio.wait(still)
        if _state["server"] is self:
            _state["server"] = None

    async def _accept_loop(self, rt: UcxRuntime) -> None:
        while True:
            try:
                buf = await rt.recv_frame(ATTACH_TAG, ATTACH_BUFFER_BYTES)
                header, payload = _parse_frame(buf, None)
                if header.type is not proto.MessageType.UCX_ATTACH:
                    raise proto.ProtocolError("unauthenticated", f"{header.type.name} before UCX_ATTACH")
                attach = proto.decode_ucx_attach(payload)
                key = self._authorize(attach.session_id)
                mac = attach_mac(key, attach.connection_id, attach.worker_address) if key else b""
                if not key or not hmac.compare_digest(mac, attach.mac):
                    raise proto.ProtocolError("unauthenticated",
                                              "UCX_ATTACH with an unknown session or a wrong MAC")
                if attach.connection_id in self._conns:
                    raise proto.ProtocolError("malformed", "UCX_ATTACH reuses a live connection id")
                if len(self._conns) >= MAX_SERVER_CONNECTIONS:
                    raise proto.ProtocolError("oversize", "too many UCX data connections")
            except proto.ProtocolError as exc:
                count_protocol_error(self._metrics, exc.reason)
                log.warning("UCX data plane: refused an attach: %s", exc)
                continue
            except Exception:  # a broken authorize callback must not stop the server
                count_protocol_error(self._metrics, "unauthenticated")
                log.exception("UCX data plane: attach check failed")
                continue
            cid = attach.connection_id
            task = asyncio.create_task(self._serve(rt, attach), name="ucx-data-conn")
            self._conns[cid] = task
            task.add_done_callback(lambda _t, cid=cid: self._conns.pop(cid, None))

    async def _serve(self, rt: UcxRuntime, attach: proto.UcxAttach) -> None:
        try:
            ep = rt.endpoint(attach.worker_address)
        except Exception as exc:  # an unusable address: nothing to answer on
            count_protocol_error(self._metrics, "malformed")
            log.warning("UCX data plane: cannot reach an attaching client: %s", exc)
            return
        conn = _ServerConnection(self, rt, ep, attach.connection_id)
        self._connections[attach.connection_id] = conn
        try:
            await conn.run()
        finally:
            self._connections.pop(attach.connection_id, None)
            conn.abort()


class _ServerConnection:
    """One client of the UCX server: reads its frames, sends its chunks.

    A FETCH is answered in batches of as many chunks as the send window admits: the
    chunks are pinned, one message tells the client every chunk's checksum (the
    batch's CHUNK and CHUNK_MISSING frames back to back), then each chunk's bytes go
    out from its pinned slot. Completions are callbacks, not a task per chunk: a
    chunk's pin is released when its send is done, or after the endpoint was
    aborted (so a slot is never reused while UCX may still read it).
    """

    def __init__(self, server: UcxDataPlaneServer, rt: UcxRuntime, ep: Any, cid: int) -> None:
        self.server = server
        self.rt = rt
        self.ep = ep
        self.cid = cid
        self.c2s = _tag(cid, TAG_C2S)
        self.s2c = _tag(cid, TAG_S2C)
        # Chunk sends in flight: token -> (its pin or None for a missing chunk, its batch).
        self.outstanding: dict[int, tuple[Any, _SendBatch]] = {}
        self._tokens = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self.window = asyncio.Semaphore(SERVER_SENDS_IN_FLIGHT)
        self.failed: BaseException | None = None
        self.aborted = False
        # Monotonic time of the last frame received or chunk sent.
        self.last = time.monotonic()

    def idle(self, now: float) -> bool:
        return not self.outstanding and now - self.last >= IDLE_CLOSE_SECONDS

    async def run(self) -> None:
        srv, rt = self.server, self.rt
        try:
            nonce = make_nonce()
            async with asyncio.timeout(srv._auth_timeout):
                await rt.send(self.ep, _buf(proto.encode_auth_challenge(nonce)), self.s2c)
                buf = await rt.recv_frame(self.c2s, CONTROL_BUFFER_BYTES)
                header, payload = _parse_frame(buf, srv._chunk_bytes)
                if header.type is not proto.MessageType.AUTH_RESPONSE:
                    raise proto.ProtocolError("unauthenticated", f"{header.type.name} before AUTH_RESPONSE")
                check_auth(srv._authorize, nonce, proto.decode_auth_response(payload))
                await rt.send(self.ep, _buf(proto.encode_auth_ok()), self.s2c)
            while self.failed is None:
                buf = await rt.recv_frame(self.c2s, CONTROL_BUFFER_BYTES)
                self.last = time.monotonic()
                header, payload = _parse_frame(buf, srv._chunk_bytes)
                mtype = header.type
                if mtype is proto.MessageType.LOOKUP:
                    hits = srv._store.lookup_prefix(proto.decode_keys(payload))
                    await rt.send(self.ep, _buf(proto.encode_lookup_reply(header.request_id, hits)),
                                  self.s2c)
                elif mtype is proto.MessageType.FETCH:
                    await self.send_chunks(header.request_id, proto.decode_keys(payload))
                elif mtype is proto.MessageType.CLOSE:
                    break
                else:
                    raise proto.ProtocolError("malformed", f"a client may not send {mtype.name}")
            await self.drained.wait()
        except proto.ProtocolError as exc:
            count_protocol_error(srv._metrics, exc.reason)
            log.warning("UCX data plane: closing a connection: %s", exc)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await rt.send(self.ep, _buf(proto.encode_error(0, exc.reason, exc.message)), self.s2c)
        except TimeoutError:
            count_protocol_error(srv._metrics, "unauthenticated")
            log.warning("UCX data plane: a client did not authenticate within %.3gs", srv._auth_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("UCX data plane: connection ended: %s", exc)
        finally:
            if self.outstanding:
                self.fail(TransportError("connection ended with chunk sends in flight"))

    async def send_chunks(self, first_id: int, keys: list[bytes]) -> None:
        """Answer one FETCH in batches of what the send window admits."""
        i = 0
        while i < len(keys) and self.failed is None:
            await self.window.acquire()  # waits only when SERVER_SENDS_IN_FLIGHT are out
            batch = [(first_id + i, keys[i])]
            i += 1
            while i < len(keys) and not self.window.locked():
                await self.window.acquire()  # free: returns at once
                batch.append((first_id + i, keys[i]))
                i += 1
            if self.failed is not None:  # failed while waiting: nothing more goes out
                for _ in batch:
                    self.window.release()
                return
            self._post_batch(batch)

    def _post_batch(self, batch: list[tuple[int, bytes]]) -> None:
        """Pin the batch's chunks, send their CHUNK / CHUNK_MISSING frames as one message
        (or several when they exceed a control frame), then post each chunk's bytes. Each
        pin is in ``outstanding`` as soon as it is taken, so whatever fails later, fail()
        releases it."""
        srv, rt = self.server, self.rt
        tracker = _SendBatch(len(batch))
        tracker.timer = rt.loop.call_later(srv._send_timeout, self._deadline, tracker)
        self.drained.clear()
        frames: list[bytes] = []
        sends: list[tuple[int, int, Any]] = []  # (token, request id, pin or None)
        for request_id, key in batch:
            pin = srv._store.pin(key)
            self._tokens += 1
            self.outstanding[self._tokens] = (pin, tracker)
            sends.append((self._tokens, request_id, pin))
            if pin is None:  # the client posted a receive for the bytes: complete it with 1 byte
                frames.append(proto.join(proto.encode_chunk_missing(request_id, key)))
            else:
                prefix = proto.encode_chunk_prefix(key, pin.checksum)
                frames.append(proto.encode_header(proto.MessageType.CHUNK, request_id,
                                                  len(prefix) + srv._chunk_bytes) + prefix)
        for message in _pack_frames(frames, CONTROL_BUFFER_BYTES):
            rt.post_send(self.ep, message, self.s2c).add_done_callback(self._control_sent)
        for token, request_id, pin in sends:
            data = pin.view if pin is not None else bytearray(1)
            rt.post_send(self.ep, data, _data_tag(self.cid, request_id)).add_done_callback(
                functools.partial(self._chunk_sent, token))

    def _control_sent(self, fut: asyncio.Future[None]) -> None:
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self.fail(exc)

    def _chunk_sent(self, token: int, fut: asyncio.Future[None]) -> None:
        entry = self.outstanding.get(token)
        if entry is None:  # released when the connection failed
            return
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            log.info("UCX data plane: chunk send failed: %s", exc)
            self.fail(exc)  # aborts the endpoint, then releases every pin
            return
        pin, tracker = self.outstanding.pop(token)
        self.last = time.monotonic()
        if pin is not None:
            pin.release()
            if self.server._metrics is not None:
                self.server._metrics.peer_bytes.labels(direction="sent").inc(self.server._chunk_bytes)
        self.window.release()
        tracker.left -= 1
        if tracker.left == 0 and tracker.timer is not None:
            tracker.timer.cancel()
        if not self.outstanding:
            self.drained.set()

    def _deadline(self, tracker: _SendBatch) -> None:
        if tracker.left and self.failed is None:
            log.info("UCX data plane: %d chunk sends missed their %.3gs deadline",
                     tracker.left, self.server._send_timeout)
            self.fail(TimeoutError("chunk sends missed their deadline"))

    def fail(self, exc: BaseException) -> None:
        """End the connection: abort the endpoint (its sends are cancelled), then release
        every pin still out."""
        if self.failed is None:
            self.failed = exc
        self.abort()
        outstanding, self.outstanding = self.outstanding, {}
        for pin, tracker in outstanding.values():
            if pin is not None:
                pin.release()
            self.window.release()
            if tracker.timer is not None:
                tracker.timer.cancel()
        self.drained.set()

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.rt.abort(self.ep)


@dataclass
class _SendBatch:
    """The chunk sends of one batch of a FETCH, under one deadline."""

    # Sends not yet completed.
    left: int
    # Fires when the batch misses the server's send timeout.
    timer: asyncio.TimerHandle | None = None


def _pack_frames(frames: list[bytes], limit: int) -> list[bytearray]:
    """Frames joined into as few messages of at most ``limit`` bytes as they fit."""
    messages: list[bytearray] = []
    current = bytearray()
    for frame in frames:
        if current and len(current) + len(frame) > limit:
            messages.append(current)
            current = bytearray()
        current += frame
    if current:
        messages.append(current)
    return messages


class UcxPeerDataClient(PeerDataClient):
    """An authenticated UCX connection to one peer's data plane.

    With two lanes it has a partner: a second authenticated connection from this
    process's ``get_zcopy`` worker (``UcxRuntime.get_lane``). A fetch sends every
    ``GET_LANE_EVERY``-th chunk over the partner (the fetcher copies those) and the
    rest over this connection (the holder copies those), so both cores copy at once.
    Lookups use this connection; a failure of either connection fails both.
    """

    def __init__(self, rt: UcxRuntime, ep: Any, cid: int, metrics: SidecarMetrics | None,
                 window: int) -> None:
        self._rt = rt
        self._ep = ep
        self._cid = cid
        self._c2s = _tag(cid, TAG_C2S)
        self._s2c = _tag(cid, TAG_S2C)
        self._metrics = metrics
        self._window = window
        self._next_rid = 1
        self._chunks: dict[int, _UcxChunk] = {}
        self._lookups: dict[int, tuple[asyncio.Future[int], int]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._partner: UcxPeerDataClient | None = None
        self._turn = 0  # chunks requested so far, modulo GET_LANE_EVERY
        self._requested = 0  # chunks requested over this connection
        self._replies = [0, 0]  # messages carrying chunk replies, CHUNK/CHUNK_MISSING frames in them

    @classmethod
    async def connect(cls, address: str, session_id: bytes, session_key: bytes, *,
                      timeout: float, metrics: SidecarMetrics | None = None,
                      window: int = UCX_WINDOW, lanes: int | None = None) -> UcxPeerDataClient:
        """Attach to the server at ``ucx://...`` and authenticate; TransportError on failure.

        ``lanes``: 1 or 2 (see ``configure_ucx_env``); default: the configured count.
        """
        lanes = _state["lanes"] if lanes is None else lanes
        if lanes not in (1, 2):
            raise ValueError(f"UCX lanes={lanes!r} is not supported; use 1 or 2")
        server_address = decode_address(address)
        deadline = time.monotonic() + timeout
        client = await cls._attach(UcxRuntime.get(), server_address, session_id, session_key,
                                   timeout, metrics, window)
        if lanes == 2:
            try:
                lane = await cls._attach(UcxRuntime.get_lane(), server_address, session_id,
                                         session_key, max(deadline - time.monotonic(), 1e-3),
                                         metrics, window)
            except BaseException:
                await client.close()
                raise
            client._partner, lane._partner = lane, client
        return client

    @property
    def lane_chunks(self) -> tuple[int, int]:
        """Chunks requested so far over the holder-copied and the fetcher-copied lane."""
        return self._requested, 0 if self._partner is None else self._partner._requested

    @property
    def chunk_replies(self) -> tuple[int, int]:
        """Server messages that carried chunk replies on this connection, and the CHUNK /
        CHUNK_MISSING frames in them (a FETCH is answered with one message per batch)."""
        return self._replies[0], self._replies[1]

    @classmethod
    async def _attach(cls, rt: UcxRuntime, server_address: bytes, session_id: bytes,
                      session_key: bytes, timeout: float, metrics: SidecarMetrics | None,
                      window: int) -> UcxPeerDataClient:
        """One authenticated connection from ``rt``'s worker; TransportError on failure."""
        cid = _new_connection_id()
        ep = None
        try:
            async with asyncio.timeout(timeout):
                ep = rt.endpoint(server_address)
                mac = attach_mac(session_key, cid, rt.address)
                await rt.send(ep, _buf(proto.encode_ucx_attach(cid, session_id, mac, rt.address)),
                              ATTACH_TAG)
                s2c, c2s = _tag(cid, TAG_S2C), _tag(cid, TAG_C2S)
                buf = await rt.recv_frame(s2c, CONTROL_BUFFER_BYTES)
                header, payload = _parse_frame(buf, None)
                _raise_if_error(header, payload)
                if header.type is not proto.MessageType.AUTH_CHALLENGE:
                    raise proto.ProtocolError("malformed", f"expected AUTH_CHALLENGE, got {header.type.name}")
                nonce = proto.decode_auth_challenge(payload)
                await rt.send(ep, _buf(proto.encode_auth_response(session_id, auth_proof(session_key, nonce))),
                              c2s)
                buf = await rt.recv_frame(s2c, CONTROL_BUFFER_BYTES)
                header, payload = _parse_frame(buf, None)
                _raise_if_error(header, payload)
                if header.type is not proto.MessageType.AUTH_OK:
                    raise proto.ProtocolError("malformed", f"expected AUTH_OK, got {header.type.name}")
                proto.decode_auth_ok(payload)
        except BaseException as exc:
            _release_connection_id(cid)
            if ep is not None:
                rt.abort(ep, wait=False)  # nothing of ours is posted into a store slot yet
            if isinstance(exc, TimeoutError):
                raise TransportError(f"connecting to the UCX peer missed its {timeout:.3g}s deadline "
                                     "(a refused session gets no answer over UCX)") from None
            if isinstance(exc, TransportError):
                raise
            if isinstance(exc, Exception):
                raise TransportError(f"connecting to the UCX peer failed: {exc}") from exc
            raise
        client = cls(rt, ep, cid, metrics, window)
        client._reader = asyncio.create_task(client._read_loop(), name="ucx-data-reader")
        return client

    def _rids(self, n: int) -> int:
        if self._next_rid + n > UCX_REQUEST_ID_MOD:  # keep a batch's ids contiguous
            self._next_rid = 1
        first = self._next_rid
        self._next_rid += n
        return first

    async def _send(self, frame: list) -> None:
        await self._rt.send(self._ep, _buf(frame), self._c2s)

    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        """Number of leading ``keys`` the peer holds (one LOOKUP round trip)."""
        self._check_open()
        keys = list(keys)
        if not keys:
            return 0
        rid = self._rids(1)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._lookups[rid] = (fut, len(keys))
        try:
            async with asyncio.timeout(timeout):
                await self._send(proto.encode_lookup(rid, keys))
                return await fut
        except TimeoutError:
            exc = TransportError(f"lookup of {len(keys)} keys missed its {timeout:.3g}s deadline")
            self._fail(exc)
            raise exc from None
        except TransportError:
            raise
        except Exception as exc:
            self._fail(exc)
            raise TransportError(f"lookup failed: {exc}") from exc
        finally:
            self._lookups.pop(rid, None)

    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float) -> int:
        """Receive chunks straight into ``store`` slots; leading keys now visible."""
        self._check_open()
        return await run_fetch(keys, store, timeout, window=self._window,
                               send_requests=self._request_chunks, fail=self._fail,
                               metrics=self._metrics)

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        """Split the batch between the lanes, then ask each lane for its part."""
        self._check_open()
        partner = self._partner
        if partner is None:
            await self._request_lane(batch)
            return
        mine: list[tuple[int, PendingChunk]] = []
        theirs: list[tuple[int, PendingChunk]] = []
        for entry in batch:
            self._turn = (self._turn + 1) % GET_LANE_EVERY
            (theirs if self._turn == 0 else mine).append(entry)
        await asyncio.gather(*(lane._request_lane(part) for lane, part
                               in ((self, mine), (partner, theirs)) if part))

    async def _request_lane(self, batch: list[tuple[int, PendingChunk]]) -> None:
        """Post the receive into each reserved slot, then ask for the chunks."""
        self._check_open()
        self._requested += len(batch)
        rid = self._rids(len(batch))
        for j, (_, p) in enumerate(batch):
            data = self._rt.post_recv(self._ep, p.reservation.view, _data_tag(self._cid, rid + j))
            self._chunks[rid + j] = _UcxChunk(p, data)
            data.add_done_callback(lambda _f, r=rid + j: self._data_arrived(r))
        await self._send(proto.encode_fetch(rid, [p.key for _, p in batch]))

    def _data_arrived(self, request_id: int) -> None:
        st = self._chunks.get(request_id)
        if st is None or st.data.cancelled():
            return
        exc = st.data.exception()
        if exc is not None:
            self._fail(exc)
            return
        self._finish(request_id, st)

    def _finish(self, request_id: int, st: _UcxChunk) -> None:
        """Both the reply frame and the bytes are in: commit (or abort a miss)."""
        if not (st.replied and st.data.done()):
            return
        del self._chunks[request_id]
        if st.checksum is None:
            st.p.reservation.abort()
            if not st.p.done.done():
                st.p.done.set_result(False)
        else:
            commit_received(st.p, st.checksum, self._metrics)

    async def close(self) -> None:
        """Send CLOSE (best effort) and close the endpoint (and the partner's)."""
        if self._error is not None:
            return
        partner = self._partner
        if partner is not None:
            self._partner = partner._partner = None
            await partner.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.5):
                await self._send(proto.encode_close())
        self._fail(TransportError("closed by this side"))
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                await self._reader

    def _fail(self, exc: BaseException) -> None:
        """Close the endpoint (cancelling receives into slots) and fail everything in flight,
        on the partner connection too."""
        first = self._error is None
        if first:
            self._error = exc
            self._rt.abort(self._ep)  # cancels posted receives: no byte lands in a slot after this
            _release_connection_id(self._cid)
        err = exc if isinstance(exc, TransportError) else TransportError(f"data connection failed: {exc}")
        if first and self._partner is not None:
            self._partner._fail(err)
        for st in self._chunks.values():
            if not st.p.done.done():
                st.p.done.set_exception(err)
        self._chunks.clear()
        for fut, _ in self._lookups.values():
            if not fut.done():
                fut.set_exception(err)
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task() and not reader.done():
            reader.cancel()

    async def _read_loop(self) -> None:
        try:
            while True:
                buf = await self._rt.recv_frame(self._s2c, CONTROL_BUFFER_BYTES)
                frames = _split_frames(buf)
                for header, payload in frames:
                    self._on_frame(header, payload)
                if frames and frames[0][0].type in _CHUNK_REPLIES:
                    self._replies[0] += 1
                    self._replies[1] += len(frames)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, proto.ProtocolError):
                count_protocol_error(self._metrics, exc.reason)
                log.warning("UCX data client: closing the connection: %s", exc)
            self._fail(exc if isinstance(exc, TransportError) else TransportError(str(exc)))

    def _on_frame(self, header: proto.Header, payload: memoryview) -> None:
        mtype = header.type
        if mtype is proto.MessageType.CHUNK:
            self._chunk_reply(header, payload)
        elif mtype is proto.MessageType.LOOKUP_REPLY:
            answer_lookup(self._lookups, header.request_id, payload)
        elif mtype is proto.MessageType.CHUNK_MISSING:
            key = proto.decode_chunk_missing(payload)
            st = self._chunks.get(header.request_id)
            if st is None or st.replied or st.p.key != key:
                raise proto.ProtocolError("bad_key", "CHUNK_MISSING for a key not requested")
            st.replied = True
            self._finish(header.request_id, st)
        else:
            _raise_if_error(header, payload)
            raise proto.ProtocolError("malformed", f"a server may not send {mtype.name} here")

    def _chunk_reply(self, header: proto.Header, payload: memoryview) -> None:
        prefix = proto.decode_chunk_prefix(payload)
        st = self._chunks.get(header.request_id)
        if st is None or st.replied or st.p.key != prefix.key:
            raise proto.ProtocolError("bad_key", f"CHUNK {prefix.key.hex()} was not requested "
                                      f"under request id {header.request_id}")
        proto.check_chunk_payload(header.length, prefix.size, st.p.nbytes)
        st.replied, st.checksum = True, prefix.checksum
        self._finish(header.request_id, st)


@dataclass
class _UcxChunk:
    """A requested chunk on a UCX connection: its receive is posted before the request."""

    # The fetch's bookkeeping (reservation, result future).
    p: PendingChunk
    # Completes when the chunk's message is in the slot (1 byte when the peer lacks it).
    data: asyncio.Future[None]
    # True once CHUNK or CHUNK_MISSING arrived.
    replied: bool = False
    # The holder's checksum (None: CHUNK_MISSING).
    checksum: int | None = None


# Frame types that answer a FETCH.
_CHUNK_REPLIES = (proto.MessageType.CHUNK, proto.MessageType.CHUNK_MISSING)

_client_cids: set[int] = set()


def _new_connection_id() -> int:
    while True:
        cid = secrets.randbits(32)
        if cid and cid not in _client_cids:
            _client_cids.add(cid)
            return cid


def _release_connection_id(cid: int) -> None:
    _client_cids.discard(cid)


def _raise_if_error(header: proto.Header, payload: memoryview) -> None:
    if header.type is proto.MessageType.ERROR:
        raise TransportError(f"peer refused: {proto.decode_error(payload)}")
    if header.type is proto.MessageType.CLOSE:
        raise TransportError("peer closed the data connection")
