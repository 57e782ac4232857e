"""UCX set-up for the data plane: environment, the process's ucxx worker(s) and their progress.

Call ``configure_ucx_env`` before ``ucxx`` is imported (UCX reads its
environment once). Progress runs in ``blocking`` mode on the asyncio loop,
driven from the worker's event descriptor (ucxx's own progress thread costs
too much on small hosts). One runtime (and one asyncio loop) per process:
ucxx keeps one global worker bound to the loop that first used it. With two
lanes a second, ``get_zcopy`` worker lets the fetcher copy part of the chunks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import check_loop

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)

# UCX transports when nothing else is configured: shared memory to same-host peers, TCP across nodes.
DEFAULT_TLS = "sm,tcp,self"

# UCX settings configure_ucx_env writes, besides UCX_TLS.
_UCX_DEFAULTS = {
    # Only for code that uses ucxx's own asyncio layer; this transport drives the worker itself.
    "UCXPY_PROGRESS_MODE": "blocking",
    # UCX over TCP assumes a slow link and uses 8 KiB segments; 1 MiB segments are much faster.
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    # A CMA (sm) rendezvous copies in segments of this size, one per progress call; the
    # default 512 KiB is slower for MiB-sized chunks.
    "UCX_CMA_SEG_SIZE": "16m",
    # ucxx sets UCX_MEMTYPE_CACHE which this UCX build does not know; keep logs quiet.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

# UCX settings of the second (fetch) lane's context: its chunks are copied by the *fetcher*.
GET_LANE_CONFIG = {"RNDV_SCHEME": "get_zcopy"}

# Lanes a UCX client uses per peer when nothing else is configured (see configure_ucx_env).
DEFAULT_LANES = 1


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
        rt = _state["runtime"]
        if rt is None:
            rt = _state["runtime"] = cls(asyncio.get_running_loop())
        check_loop(rt.loop, "UCX")
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
            if n > limit or is_truncated(exc):
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


def is_truncated(exc: BaseException) -> bool:
    return "Truncated" in type(exc).__name__


def register_server(server: Any) -> None:
    """Record the process's one UCX server (its connections are progressed fairly)."""
    if _state["server"] is not None:
        raise RuntimeError("a UCX data-plane server already runs in this process; "
                           "start one per sidecar process")
    _state["server"] = server


def unregister_server(server: Any) -> None:
    if _state["server"] is server:
        _state["server"] = None


def _resolve(req: Any, fut: asyncio.Future[None]) -> None:
    """Complete ``fut`` with the outcome of the finished UCX request ``req``."""
    try:
        req.check_error()
    except Exception as exc:
        fut.set_exception(exc)
        fut.exception()  # a waiter that gave up must not log "never retrieved"
    else:
        fut.set_result(None)


