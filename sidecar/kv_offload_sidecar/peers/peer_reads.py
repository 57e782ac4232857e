"""The engine path's peer side: find the chunks a sidecar lacks and bring them in.

For the keys after the local prefix: ask the owner of the first one which
peers hold it (``Location.locate``: one message, none when this sidecar owns
it), then exchange with one holder (a trusted, connected one, best first):

- ``lookup(fetch=True)`` (the engine's lookup): one exchange that asks the
  holder's hit prefix and fetches it (``fetch_counted``); the lookup answers
  as soon as the count is back, the chunks keep arriving in the background
  and ``load`` waits for them. Two messages per request with peer hits.
- ``lookup(fetch=False)`` (the admin lookup, probes): the count only.
- ``load`` without a lookup in flight: locate, then fetch.

Every failure or deadline is a miss; a failing peer is reported for back-off
(``links.PeerManager.report_failure``). An owner that names a holder without
the chunk, and a holder named for a chunk it lacks, each count one false
claim (``claims.ClaimAudit``, keys ``owner:<id>`` and ``<id>``); distrusted
ones are not asked. Fetched chunks are demoted once loaded (the pool keeps
them elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.peers.location_wire import HolderClaim

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.peers.claims import ClaimAudit
    from kv_offload_sidecar.peers.links import PeerLink, PeerManager
    from kv_offload_sidecar.peers.location import Location
    from kv_offload_sidecar.store.chunk_store import ChunkStore

log = logging.getLogger(__name__)

# Keys asked of a peer in one lookup/fetch (protocol MAX_KEYS bound).
MAX_PEER_KEYS = 65536
# Fetches started by lookups and not finished yet (past this, a lookup only counts).
MAX_PREFETCHES = 1024
# Fetched chunks remembered until their load demotes them (oldest forgotten first).
MAX_FETCHED = 65536
# Prefix of an owner's key in the claim audit.
OWNER_PREFIX = "owner:"


@dataclass
class _Prefetch:
    """A fetch a lookup started, awaited by the load that follows."""

    # The keys asked (the lookup's keys after the local prefix).
    keys: list[bytes]
    # The holder's hit prefix, once its LOOKUP answer is back.
    count: asyncio.Future[int]
    # The exchange itself (resolves to the chunks fetched).
    task: asyncio.Task[int] | None = None
    # The holder asked.
    holder: str = ""


class PeerReads:
    """Lookups and loads of chunks this sidecar lacks, from the peers the directory names."""

    def __init__(self, *, location: Location, peers: PeerManager, claims: ClaimAudit,
                 metrics: SidecarMetrics, store: Callable[[], ChunkStore], deadline_seconds: float) -> None:
        self._location = location
        self._peers = peers
        self._claims = claims
        self._metrics = metrics
        self._store = store
        self._deadline = deadline_seconds
        self._inflight: dict[bytes, _Prefetch] = {}
        self._fetched: OrderedDict[bytes, None] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- engine operations ---------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes], local: int, timeout: float, *, fetch: bool) -> int:
        """Peer hit prefix of ``keys[local:]`` (the first ``local`` are held here); with ``fetch``
        the chunks start coming."""
        deadline = min(timeout, self._deadline)
        found = self._pending(keys, local)
        if found is not None:
            start, pending = found
            return max(0, await self._count_of(pending, keys[start:], deadline) - (local - start))
        rest = list(keys[local:local + MAX_PEER_KEYS])
        holder = await self._holder(rest, deadline)
        if holder is None:
            return 0
        link, claim, owner = holder
        if not fetch or len(self._inflight) >= MAX_PREFETCHES:
            return await self._exchange(link, claim, owner, rest, deadline, fetch=False)
        prefetch = _Prefetch(rest, asyncio.get_running_loop().create_future(), holder=claim.identity)
        self._inflight[rest[0]] = prefetch
        prefetch.task = self._spawn(self._prefetch(prefetch, link, claim, owner))
        return await self._count_of(prefetch, rest, deadline)

    async def load(self, keys: Sequence[bytes], local: int, timeout: float) -> None:
        """Make ``keys[local:]`` local as far as the pool has them (the first ``local`` are)."""
        found = self._pending(keys, local)
        if found is not None and found[1].task is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(found[1].task), timeout)
            return
        rest = list(keys[local:local + MAX_PEER_KEYS])
        deadline = min(timeout, self._deadline)
        holder = await self._holder(rest, deadline)
        if holder is not None:
            await self._exchange(*holder, rest, deadline, fetch=True)

    def _pending(self, keys: Sequence[bytes], local: int) -> tuple[int, _Prefetch] | None:
        """A lookup's fetch still running for these keys: ``(index of its first key, it)``.
        It started at the first key not held then, which is at or before ``local`` now."""
        for i in range(min(local, len(keys) - 1), -1, -1):
            pending = self._inflight.get(keys[i])
            if pending is not None:
                return i, pending
        return None

    def take_fetched(self, keys: Sequence[bytes]) -> list[bytes]:
        """Which of ``keys`` came from peers (and are now loaded: the caller demotes them)."""
        out = [k for k in keys if k in self._fetched]
        for k in out:
            del self._fetched[k]
        return out

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # ---- steps ----------------------------------------------------------------------------

    async def _holder(self, keys: list[bytes], deadline: float) -> tuple[PeerLink, HolderClaim, str] | None:
        """Ask the owner of ``keys[0]``; the first trusted, connected holder it names (and the owner)."""
        owner = self._location.owner_of(keys[0])
        distrusted = self._claims.distrusted()
        if OWNER_PREFIX + owner in distrusted:
            return None
        if owner != self._location.identity:
            self._metrics.lookup_messages.inc()
        try:
            owner, holders = await self._location.locate(keys, deadline)
        except (ConnectionError, asyncio.TimeoutError, OSError, ValueError) as exc:
            link = self._peers.connected(owner)
            log.warning("owner %s could not say where chunks are (%s); a miss", owner, exc)
            if link is not None:
                self._peers.report_failure(link, f"locate: {exc}")
            return None
        for claim in holders:
            if claim.identity in distrusted or claim.identity == self._location.identity:
                continue
            link = self._peers.connected(claim.identity)
            if link is not None and link.data is not None and not link.data.closed:
                return link, claim, owner
        return None

    async def _prefetch(self, prefetch: _Prefetch, link: PeerLink, claim: HolderClaim, owner: str) -> int:
        try:
            return await self._exchange(link, claim, owner, prefetch.keys, self._deadline, fetch=True,
                                        on_count=lambda n: _resolve(prefetch.count, n))
        finally:
            _resolve(prefetch.count, 0)
            self._inflight.pop(prefetch.keys[0], None)

    async def _exchange(self, link: PeerLink, claim: HolderClaim, owner: str, keys: list[bytes],
                        deadline: float, *, fetch: bool, on_count: Callable[[int], None] | None = None) -> int:
        """One exchange with the holder (a count, a fetch, or both); 0 on any failure."""
        from kv_offload_sidecar.data import TransportError

        self._metrics.lookup_messages.inc()
        if fetch:  # marked before they land: a load may pin them before this returns
            self._location.mark_copies(keys)
            self._remember(keys)
        got = 0
        try:
            if not fetch:
                coro = link.data.lookup(keys, deadline)
            elif on_count is not None:
                # One key ahead of the count: a claim may be stale, and a slot reserved past the
                # holder's run would evict one of our chunks for nothing.
                coro = link.data.fetch_counted(keys, self._store(), deadline, first=1,
                                               on_count=on_count)
            else:
                coro = link.data.fetch(keys, self._store(), deadline)
            # The transport enforces the deadline; this bound only guards against a hang.
            got = int(await asyncio.wait_for(coro, deadline + 1.0))
        except (TransportError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.warning("peer %s %s failed: %s; a miss, backing the peer off", claim.identity,
                        "fetch" if fetch else "lookup", exc)
            self._peers.report_failure(link, f"{'fetch' if fetch else 'lookup'}: {exc}")
            return 0
        finally:
            if fetch:
                self._forget(keys[got:])
        backed = 1 if got else 0
        self._claims.record(claim.identity, 1, backed)
        if owner != self._location.identity:
            self._claims.record(OWNER_PREFIX + owner, 1, backed)
        return got

    async def _count_of(self, prefetch: _Prefetch, keys: Sequence[bytes], deadline: float) -> int:
        """The prefetch's count, as far as it covers ``keys``; 0 past ``deadline``."""
        try:
            n = await asyncio.wait_for(asyncio.shield(prefetch.count), deadline)
        except asyncio.TimeoutError:
            return 0
        same = 0
        for a, b in zip(prefetch.keys[:n], keys):
            if a != b:
                break
            same += 1
        return same

    def _remember(self, keys: list[bytes]) -> None:
        for k in keys:
            self._fetched[k] = None
            self._fetched.move_to_end(k)
        while len(self._fetched) > MAX_FETCHED:
            self._fetched.popitem(last=False)

    def _forget(self, keys: list[bytes]) -> None:
        for k in keys:
            self._fetched.pop(k, None)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _resolve(fut: asyncio.Future[int], n: int) -> None:
    if not fut.done():
        fut.set_result(n)
