"""Data links on demand: a member's data connection is opened when the engine path first
needs it, closed when idle, and at most ``max_open`` of them are open at once.

A handshake makes a peer a member (``links.PeerManager``): its session is key material only,
no socket is held. ``DataLinks.acquire`` opens the data connection with its lanes
(``data.connect``) the first time an exchange with that peer needs it; requests that arrive
while it opens share that one open, each waiting no longer than its own deadline. The open
itself is bounded by ``PeerSettings.handshake_timeout_seconds``; one that fails reports
the peer (``PeerManager.report_failure``: it leaves the membership and backs off) unless
this sidecar's own loop stalled meanwhile (``loop_stalls``) or the holder refused it as busy
(``PeerBusy``: it serves ``data.serving.MAX_SERVED_SESSIONS`` readers already; a miss).

- **Idle.** A data connection with no exchange for ``idle_seconds`` (``DATA_IDLE_SECONDS``,
  40 heartbeat periods: a peer read from every few seconds keeps its link, one read from
  once stays open no longer than that) is closed by the link's watch within one heartbeat
  period more; the holder's server sees the close (EOF) at once and ends its side. Heartbeats
  (``liveness``) run only while a data connection is open.
- **Bound.** Opening one more than ``max_open`` (``MAX_DATA_LINKS``) closes the least
  recently used idle one; when every open link has an exchange in flight the open is
  refused (``DataLinkUnavailable``: that request is a miss, nobody is blamed).

The link fields this uses (``data``, ``opening``, ``busy``, ``used_at``, ``stir``) are
``links.PeerLink``'s. Everything here runs on the sidecar's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data.base import PeerBusy
from kv_offload_sidecar.data.lanes import data_lanes_of, lane_count, lanes_offered
from kv_offload_sidecar.peers.liveness import HEARTBEAT_SECONDS

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.peers.handshake import Session
    from kv_offload_sidecar.peers.links import PeerLink
    from kv_offload_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

# Data connections (each with its lanes) open at once, to as many peers.
MAX_DATA_LINKS = 64
# Seconds without an exchange after which a peer's data connection is closed.
DATA_IDLE_SECONDS = 40 * HEARTBEAT_SECONDS
# Seconds a data connection's close may take before it is left to itself.
DATA_CLOSE_SECONDS = 1.0


async def close_quietly(data: Any) -> None:
    """Close a data connection, waiting ``DATA_CLOSE_SECONDS`` at most; its errors are dropped."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DATA_CLOSE_SECONDS):
            await data.close()


class DataLinkUnavailable(ConnectionError):
    """No data connection for this request: its open failed or outlasted the request's
    deadline, or every open link is busy. A miss; the peer was reported by the open itself."""


class DataLinks:
    """The open (and opening) data connections of one sidecar's links, least recently used first."""

    def __init__(self, settings: SidecarSettings, metrics: SidecarMetrics, *,
                 data_options: Callable[[], dict[str, Any]],
                 on_failed: Callable[[PeerLink, str, float], None],
                 idle_seconds: float = DATA_IDLE_SECONDS, max_open: int = MAX_DATA_LINKS) -> None:
        self._settings = settings
        self._metrics = metrics
        # The data-plane options of a new connection (the live TLS client context), read at each one.
        self._data_options = data_options
        # Told (link, error, when the open began) when an open failed.
        self._on_failed = on_failed
        # Seconds without an exchange before a data connection closes.
        self.idle_seconds = idle_seconds
        # Data connections open (or opening) at once, at most.
        self.max_open = max_open
        self._open: OrderedDict[int, PeerLink] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()
        # Data clients replaced by a re-key, closed once their last request is over.
        self._retiring: set[asyncio.Task[None]] = set()
        # Data connections opened since start (each a connection per lane).
        self.opened = 0

    # ---- queries ---------------------------------------------------------------

    def count(self) -> int:
        """Data links open or opening now."""
        return len(self._open)

    def view(self) -> dict[str, int]:
        """For /v1/status: open now, the bound, opened since start."""
        return {"open": self.count(), "max": self.max_open, "opened_total": self.opened}

    def is_idle(self, link: PeerLink, now: float | None = None) -> bool:
        """No exchange in flight and none for ``idle_seconds``."""
        now = time.monotonic() if now is None else now
        return link.busy == 0 and now - link.used_at >= self.idle_seconds

    # ---- the engine path ----------------------------------------------------------

    async def open(self, link: PeerLink, timeout: float) -> Any:
        """The link's data client, opened now if need be (the engine path holds it through
        ``acquire`` instead, so that it is not closed under an exchange)."""
        async with self.acquire(link, timeout) as data:
            return data

    @contextlib.asynccontextmanager
    async def acquire(self, link: PeerLink, deadline: float) -> AsyncIterator[Any]:
        """The link's open data client for one exchange (opened now if need be, within
        ``deadline`` seconds); the link counts as busy until the exchange ends.
        ``DataLinkUnavailable`` when there is none."""
        link.busy += 1
        self._touch(link)
        try:
            yield await self._client(link, deadline)
        finally:
            link.busy -= 1
            self._touch(link)

    async def _client(self, link: PeerLink, deadline: float) -> Any:
        data = link.data
        if data is not None:
            if data.closed:  # the peer closed it: the link's watch reconnects
                raise DataLinkUnavailable(f"data link to {link.identity} closed")
            return data
        if link.opening is None:
            if link.session is None:
                raise DataLinkUnavailable(f"peer {link.identity} has no session")
            if not self._make_room(link):
                raise DataLinkUnavailable(f"all {self.max_open} data links are busy")
            link.opening = asyncio.create_task(self._open_link(link, link.session),
                                               name=f"data link {link.address}")
            link.opening.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
            self._open[id(link)] = link
            self._update_gauges()
        opening = link.opening
        try:
            async with asyncio.timeout(max(0.0, deadline)):
                return await asyncio.shield(opening)
        except TimeoutError:
            raise DataLinkUnavailable(f"data link to {link.identity} not open within {deadline:.3f} s") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request itself is cancelled
            raise DataLinkUnavailable(f"data link to {link.identity} closed while it opened") from None
        except DataLinkUnavailable:
            raise
        except Exception as exc:
            raise DataLinkUnavailable(f"data link to {link.identity}: {exc}") from exc

    async def _open_link(self, link: PeerLink, session: Session) -> Any:
        started = asyncio.get_running_loop().time()
        link.open_reached = False
        me = asyncio.current_task()

        def reached() -> None:  # this open (not a later one) got through to the holder's host
            if link.opening is me:
                link.open_reached = True

        try:
            data = await self.connect(session, reached)
        except BaseException as exc:
            if link.opening is asyncio.current_task():
                link.opening = None
                self._forget(link)
            if isinstance(exc, Exception) and not isinstance(exc, PeerBusy):  # busy: a miss, no blame
                self._on_failed(link, f"data connect: {type(exc).__name__}: {exc}", started)
            raise
        link.opening = None
        if link.session is not session:  # the link was reset while this opened
            self._close_soon(data)
            self._forget(link)
            raise DataLinkUnavailable(f"peer {link.identity} was reset while its data link opened")
        link.data = data
        link.stir.set()  # the watch starts its heartbeats
        self._update_gauges()
        log.info("peer %s (%s): data link open (%d lanes)", link.address, link.identity, data_lanes_of(data))
        return data

    def check_dialable(self, address: str) -> None:
        """TransportError (or ValueError) unless this sidecar can dial the peer's data address:
        its TLS setting and the address's scheme agree. A peer it cannot dial is no member (it
        would own buckets and name holders that nobody here can read)."""
        from kv_offload_sidecar.data.address import check_tls_policy, parse_address

        check_tls_policy(address, parse_address(address)[0], self._data_options().get("ssl"))

    async def connect(self, session: Session, reached: Callable[[], None] | None = None) -> Any:
        """A new data client for ``session`` (the lanes both offer), bounded by the handshake
        timeout; ``reached()`` once it got through to the holder's host (``data.connect``)."""
        from kv_offload_sidecar.data import connect as data_connect

        s = self._settings
        lanes = lane_count(lanes_offered(s.data_plane.lanes), session.peer.data_lanes)
        data = await data_connect(session.peer.data_address, session.session_id, session.session_key,
                                  timeout=s.peers.handshake_timeout_seconds, metrics=self._metrics,
                                  lanes=lanes, reached=reached, reach=session.peer.control_address,
                                  **self._data_options())
        self.opened += 1
        return data

    def _make_room(self, link: PeerLink) -> bool:
        """Close the least recently used idle links until one more fits; False when none can go."""
        while len(self._open) >= self.max_open:
            victim = next((other for other in self._open.values()
                           if other is not link and other.busy == 0 and other.opening is None), None)
            if victim is None:
                return False
            log.info("peer %s (%s): data link closed for another (%d open at most)",
                     victim.address, victim.identity, self.max_open)
            self.close(victim)
        return True

    # ---- closing ----------------------------------------------------------------

    def close(self, link: PeerLink) -> None:
        """Close the link's data connection (and an open in progress), in the background."""
        data, link.data = link.data, None
        opening, link.opening = link.opening, None
        if opening is not None:
            opening.cancel()
        self._forget(link)
        if data is not None:
            self._close_soon(data)

    async def close_now(self, link: PeerLink) -> None:
        """``close``, waiting (1 s at most) for the data connection to close."""
        data = link.data
        self.close(link)
        if data is not None:
            await close_quietly(data)

    def retire(self, data: Any, delay: float) -> None:
        """Close ``data`` (replaced by a re-key) in ``delay`` seconds, once the requests running
        on it are over (they have a deadline); at once when the links close."""
        async def close_later() -> None:
            try:
                await asyncio.sleep(delay)
            finally:
                await close_quietly(data)

        self._spawn(close_later(), self._retiring)

    async def aclose(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for task in list(self._retiring) + list(self._closing):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _close_soon(self, data: Any) -> None:
        self._spawn(close_quietly(data), self._closing)

    @staticmethod
    def _spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
        """Run ``coro`` as a task held in ``tasks`` until it ends."""
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _forget(self, link: PeerLink) -> None:
        self._open.pop(id(link), None)
        self._update_gauges()

    def _touch(self, link: PeerLink) -> None:
        link.used_at = link.heard_at = time.monotonic()
        if id(link) in self._open:
            self._open.move_to_end(id(link))

    def _update_gauges(self) -> None:
        self._metrics.peer_data_links.set(sum(1 for link in self._open.values() if link.data is not None))
        self._metrics.peer_data_lanes.set(sum(data_lanes_of(link.data) for link in self._open.values()))
