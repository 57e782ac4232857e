"""Lanes: one holder's chunks fetched over several connections at once.

One TCP connection moves what one core can copy out of the kernel and hash (about 2 GB/s
on the hosts measured here; 1.9 GB/s over loopback into a registered region on a 16-core
GPU host), below the 3-10 GB/s a peer hit must deliver to beat a GPU's recompute. Each
connection moves its chunks on a thread of its own (``tcp.stream_worker``), on both ends,
so ``n`` connections use up to ``n`` cores on each side.

"Lanes" means one thing on every plane: the parallel streams one fetch stripes over, the
sidecar's ``--lanes`` (the pool's ``spec.sidecar.dataPlane.lanes``). Each plane maps it:
tcp (and TLS) opens that many connections (this module); nixl runs that many read threads,
each with a NIXL agent (``nixl.runtime``); ucx opens ``ucx_lanes`` connections, 1 or 2 (its
second is a ``get_zcopy`` lane, ``ucx.runtime``).

How many: ``lane_count`` of the two sidecars' offers, each the cores its process may use
(its CPU budget, ``cpu_budget``) or its ``--lanes``, capped
at ``MAX_DATA_LANES``. The handshake's hello carries the offer (``data_lanes``); a peer
that does not state one gets one lane. The count is shown per peer in ``/v1/peers`` and in
all as ``kv_offload_peer_data_lanes``.

``LanedPeerDataClient`` keeps the contract of one connection (``data.base.PeerDataClient``)
over ``n`` lanes and one control connection (``n + 1`` connections, a holder's
``connections_per_session`` allows them: ``serving.SESSION_CONNECTION_MARGIN``). LOOKUPs and
heartbeats go on the control connection, which carries no chunk bytes: a lookup never waits
behind a chunk the holder is sending (nor behind the kernel's socket buffers full of them).
A fetch is one ``fetch.run_fetch`` whose requests are striped over the lanes from a start
lane that rotates (chunk ``i`` of a fetch on lane ``(start + i) % n``, each fetch starting
where the previous one's stripe ended), so small fetches spread over every lane; its window,
the count bound, its deadline and every chunk's verification are those of a single
connection's fetch. Any connection that fails ends them all (the link reconnects). The
holder sees only more connections of the session: nothing on the wire changed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from kv_offload_sidecar.cpu_budget import cpu_budget
from kv_offload_sidecar.data.base import PeerDataClient, StoreLike, TransportError
from kv_offload_sidecar.data.fetch import PendingChunk, run_fetch
from kv_offload_sidecar.data.peer_client import FramedPeerDataClient
from kv_offload_sidecar.settings import MAX_DATA_LANES


# Chunks in flight per lane at least, so each lane's next chunk is asked for while its
# current one arrives.
CHUNKS_PER_LANE = 2


def lanes_offered(setting: int) -> int:
    """What this sidecar offers its peers: ``--lanes`` when set (> 0), else one lane per
    core of the CPU budget, at most ``MAX_DATA_LANES`` either way."""
    return max(1, min(MAX_DATA_LANES, setting if setting > 0 else cpu_budget().cpus))


def ucx_lanes(setting: int) -> int:
    """The ucx plane's connections per peer for ``--lanes`` ``setting``: 1 for 0 (unset) or 1,
    else 2, the most it runs. Unset stays at 1 on ucx: with a second lane the fetcher copies
    too, and a holder killed mid-transfer can then abort the fetching process."""
    return 1 if setting <= 1 else 2


def lane_count(own: int, peer: int | None) -> int:
    """Lanes between two sidecars: the smaller offer (a peer stating none gets one lane)."""
    return max(1, min(MAX_DATA_LANES, own, peer or 1))


def data_lanes_of(client: object) -> int:
    """Lanes behind a peer's data client (0 for none): its connections (tcp, ucx), or the
    process's read threads (nixl)."""
    if client is None:
        return 0
    return int(getattr(client, "lanes", 1))


async def open_lanes(n: int, open_one: Callable[[], Awaitable[FramedPeerDataClient]]) -> PeerDataClient:
    """``n`` lanes and a control connection made by ``open_one``, as one client. The control
    connection is opened alone (a holder that refuses us refuses once), the lanes together;
    if any fails, those opened are closed and the error raised."""
    control = await open_one()
    rest = await asyncio.gather(*(open_one() for _ in range(max(1, n))), return_exceptions=True)
    opened = [control, *(c for c in rest if not isinstance(c, BaseException))]
    error = next((c for c in rest if isinstance(c, BaseException)), None)
    if error is not None:
        for client in opened:
            with contextlib.suppress(Exception):
                await client.close()
        raise error
    return LanedPeerDataClient(opened[1:], control=control)


class LanedPeerDataClient(FramedPeerDataClient):
    """Several authenticated connections to one holder, used as one: the framed client's
    fetch (``fetch.run_fetch``) with its requests striped over the lanes, lookups and
    heartbeats on the control connection (the first lane when there is none)."""

    def __init__(self, lanes: Sequence[FramedPeerDataClient], *,
                 control: FramedPeerDataClient | None = None) -> None:
        if not lanes:
            raise ValueError("a laned client needs at least one connection")
        first = lanes[0]
        super().__init__(first._metrics, max(first._window, CHUNKS_PER_LANE * len(lanes)))
        self._lanes = list(lanes)
        self._control = control if control is not None else first
        # Every connection, the control connection first (each gets the heartbeat).
        self.connections = [self._control, *(lane for lane in self._lanes if lane is not self._control)]
        # The lane the next fetch's first chunk goes on.
        self._next_lane = 0
        self.receives_into_offered_rows = first.receives_into_offered_rows

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    @property
    def heard_at(self) -> float:
        """The last frame from the holder on any lane (monotonic)."""
        return max(c.heard_at for c in self.connections)

    @heard_at.setter
    def heard_at(self, _value: float) -> None:  # each lane's reader keeps its own
        pass

    @property
    def closed(self) -> bool:
        return self._error is not None or any(c.closed for c in self.connections)

    def _check_open(self) -> None:
        for c in self.connections:
            if c.closed and self._error is None:
                self._error = c._error
        super()._check_open()

    async def lookup(self, keys: Sequence[bytes], timeout: float) -> int:
        self._check_open()
        return await self._control.lookup(keys, timeout)

    async def ping(self, silence: float) -> float:
        self._check_open()
        return await self._control.ping(silence)

    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                    count: asyncio.Future[int] | None = None, first: int = 1) -> int:
        """The framed client's fetch, its chunk ``i`` on lane ``(start + i) % n``; the next
        fetch starts on the lane after this one's last chunk."""
        self._check_open()
        start = self._next_lane
        self._next_lane = (start + len(keys)) % len(self._lanes)
        return await run_fetch(keys, store, timeout, window=self._window,
                               send_requests=lambda batch: self._stripe(batch, start), fail=self._fail,
                               metrics=self._metrics, count=count, first=first)

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        await self._stripe(batch, 0)

    async def _stripe(self, batch: list[tuple[int, PendingChunk]], start: int) -> None:
        n = len(self._lanes)
        stripes: list[list[tuple[int, PendingChunk]]] = [[] for _ in range(n)]
        for index, pending in batch:
            stripes[(start + index) % n].append((index, pending))
        sends = [lane._request_chunks(stripe) for lane, stripe in zip(self._lanes, stripes, strict=True) if stripe]
        if len(sends) == 1:  # the usual batch (one chunk landed, one asked for): no task made
            await sends[0]
        else:
            await asyncio.gather(*sends)

    def _fail(self, exc: BaseException) -> None:
        """End every connection (each stops its thread's writes first, see ``tcp.client``)."""
        if self._error is None:
            self._error = exc
        for c in self.connections:
            c._fail(exc)

    async def close(self) -> None:
        results = await asyncio.gather(*(c.close() for c in self.connections), return_exceptions=True)
        if self._error is None:
            self._error = TransportError("closed by this side")
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r


__all__ = ["CHUNKS_PER_LANE", "LanedPeerDataClient", "MAX_DATA_LANES", "data_lanes_of", "lane_count",
           "lanes_offered", "open_lanes"]
