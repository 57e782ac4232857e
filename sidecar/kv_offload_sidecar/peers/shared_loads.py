"""One fetch per pod for a key: the loads of one sidecar's engines and ranks share fetches.

Several load jobs of one pod may ask for the same keys at once: the data-parallel ranks of
an engine serving one system prompt, or engines sharing a sidecar. ``SharedLoads.load_each``
(``Sidecar.load_each``'s body) makes a load's keys local, handing each chunk over as it is
here, and shares the work with the other loads in flight:

Contract:
- One fetch per key: a load whose first missing key a fetch of another load covers joins
  that fetch (``kv_offload_fetches_joined_total``) instead of asking the holder again. A
  fetch runs while any load waits on it (the one that started it may end first); it is
  cancelled when the last leaves. A load still short once a fetch shared by several loads
  ended (another job's end may have cut it: a row withdrawn mid-chunk ends the connection)
  fetches the rest itself, once (joining another load's retry, if one runs).
- One fetch for concurrent lookups too: an engine lookup whose first missing key another
  engine lookup is asking about waits for that one's answer (which started the fetch), then
  asks again (``PeerReads.lookup`` answers from the fetch in flight, the store from what
  landed), so two ranks' lookups of one prompt start one fetch.
- Every job gets its rows: a chunk that lands in one job's offered row while another load
  waits for the key without a row of its own is committed to the store too, and a load that
  comes once the chunk is in another job's row copies it from there (``row_landings``).
- A late transfer never writes a row given back: only a job's own offers are written, and
  they are withdrawn with the job (``row_landings``); a shared fetch that outlives the job
  that started it lands in store slots.
- The pool keeps fetched chunks at their holders: a load that ends lets go of (drops, or
  demotes) the fetched chunks it loaded, except those another load still waits for; the
  last load waiting for them lets go of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.peers.peer_reads import PeerReads
    from kv_offload_sidecar.peers.row_landings import Landing, RowLandings
    from kv_offload_sidecar.store.chunk_store import ChunkStore
    from kv_offload_sidecar.store.handles import PinnedChunk


class _Fetch:
    """A fetch one load started, with the loads waiting on it."""

    def __init__(self, keys: list[bytes], task: asyncio.Task[None]) -> None:
        # The keys it covers (the starting load's keys from its first missing one).
        self.keys = keys
        # reads.load for them.
        self.task = task
        # Loads waiting on it.
        self.loads = 1
        # Another load joined it (its end may have been another job's: a row withdrawn mid-chunk).
        self.shared = False


class SharedLoads:
    """Loads in flight on one sidecar, by key (used on its event loop only)."""

    def __init__(self, *, store: Callable[[], ChunkStore], reads: PeerReads, landings: RowLandings,
                 metrics: SidecarMetrics, arrivals: Callable[[], asyncio.Event],
                 let_go: Callable[[ChunkStore, list[bytes]], None],
                 unloaded_after: Callable[[], float]) -> None:
        self._store = store
        self._reads = reads
        self._landings = landings
        self._metrics = metrics
        # The event set at the next arrival (a chunk visible in the store or landed in a row).
        self._arrivals = arrivals
        # Drops or demotes fetched chunks once loaded (the sidecar's --peer-copies policy).
        self._let_go = let_go
        # Seconds after which chunks a lookup fetched and no load took are let go.
        self._unloaded_after = unloaded_after
        # Key -> the fetch in flight covering it.
        self._fetches: dict[bytes, _Fetch] = {}
        # Key -> loads waiting for it.
        self._waiting: dict[bytes, int] = {}
        # Fetched chunks a load that ended left for the loads still waiting for them.
        self._held: set[bytes] = set()
        # First missing key -> the engine lookup asking about it (done once it answered).
        self._lookups: dict[bytes, asyncio.Future[None]] = {}

    @property
    def in_flight(self) -> int:
        """Fetches loads started that have not ended."""
        return len({id(f) for f in self._fetches.values()})

    async def lookup(self, keys: Sequence[bytes], local: int, timeout: float, *,
                     fetch: bool) -> tuple[int, int]:
        """``(local, peer)`` hit prefixes of ``keys``, the first ``local`` held here: the peer
        lookup (``PeerReads.lookup``), after the engine lookup of the same first missing key
        in flight, if any (then with the local prefix counted again)."""
        if not fetch:
            return local, await self._reads.lookup(keys, local, timeout, fetch=False)
        loop = asyncio.get_running_loop()
        key, end = keys[local], loop.time() + timeout
        ahead = self._lookups.get(key)
        if ahead is not None:
            await asyncio.wait({ahead}, timeout=timeout)
            local = self._store().lookup_prefix(keys)
            if local >= len(keys):
                return local, 0
            return local, await self._reads.lookup(keys, local, max(0.0, end - loop.time()), fetch=True)
        mine: asyncio.Future[None] = loop.create_future()
        self._lookups[key] = mine
        try:
            return local, await self._reads.lookup(keys, local, timeout, fetch=True)
        finally:
            if self._lookups.get(key) is mine:
                del self._lookups[key]
            mine.set_result(None)

    async def load_each(self, keys: Sequence[bytes], timeout: float,
                        take: Callable[[PinnedChunk | None], None],
                        rows: Sequence[Landing | None] = ()) -> int:
        """See ``Sidecar.load_each``."""
        store = self._store()
        loop = asyncio.get_running_loop()
        end, n = loop.time() + timeout, 0
        while n < len(keys) and (pin := take_pin(store, keys[n], _row(rows, n))) is not None:
            take(pin)
            n += 1
        waited = list(keys[n:])
        bare = [k for i, k in enumerate(keys[n:], n) if _row(rows, i) is None]
        if n < len(keys):
            self._wait(waited)
            self._landings.wait(bare)
            fetch = self._join(keys, n, timeout)
            again = True  # a fetch of its own should a shared one end short
            try:
                while n < len(keys):
                    arrived = self._arrivals()
                    row = _row(rows, n)
                    pin = take_pin(store, keys[n], row)
                    if pin is None and row is None and self._landings.share(keys[n], store):
                        pin = store.pin(keys[n])
                    if pin is not None or (row is not None and row.landed):
                        take(pin)
                        n += 1
                    elif fetch.task.done():
                        if not (again and fetch.shared):
                            break
                        again = False
                        await self._leave(fetch)
                        fetch = self._join(keys, n, max(0.0, end - loop.time()))  # within its own time
                    else:
                        waiter = asyncio.ensure_future(arrived.wait())
                        try:
                            await asyncio.wait({fetch.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                        finally:
                            waiter.cancel()
            finally:
                self._landings.unwait(bare)
                if held := self._unwait(waited):  # held for this load alone
                    self._let_go(store, held)
                await self._leave(fetch)
        # The pool keeps fetched chunks at their holders: once loaded, this store drops them (or,
        # with --peer-copies cold, keeps them at its cold end); so too those a lookup fetched and
        # no load took in time; but not while another load waits for them.
        fetched = self._reads.take_fetched(keys) + self._reads.take_unloaded(self._unloaded_after())
        self._held.update(k for k in fetched if k in self._waiting)
        self._let_go(store, [k for k in fetched if k not in self._waiting])
        return n

    def _join(self, keys: Sequence[bytes], n: int, timeout: float) -> _Fetch:
        """The fetch in flight covering ``keys[n]`` (joined), else one started for ``keys[n:]``."""
        found = self._fetches.get(keys[n])
        if found is not None and not found.task.done():
            found.loads += 1
            found.shared = True
            self._metrics.fetches_joined.inc()
            return found
        fetch = _Fetch(list(keys[n:]), asyncio.ensure_future(self._reads.load(keys, n, timeout)))
        for key in fetch.keys:
            self._fetches[key] = fetch
        fetch.task.add_done_callback(lambda _t, f=fetch: self._ended(f))
        return fetch

    def _ended(self, fetch: _Fetch) -> None:
        for key in fetch.keys:
            if self._fetches.get(key) is fetch:
                del self._fetches[key]

    async def _leave(self, fetch: _Fetch) -> None:
        """One load stops waiting on ``fetch``; the last one cancels it if still running."""
        fetch.loads -= 1
        if fetch.loads > 0 or fetch.task.done():
            return
        fetch.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await fetch.task

    def _wait(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._waiting[key] = self._waiting.get(key, 0) + 1

    def _unwait(self, keys: Sequence[bytes]) -> list[bytes]:
        """Stop waiting for ``keys``; the held chunks no load waits for any more."""
        done = []
        for key in keys:
            left = self._waiting.get(key, 0) - 1
            if left > 0:
                self._waiting[key] = left
                continue
            self._waiting.pop(key, None)
            if key in self._held:
                self._held.discard(key)
                done.append(key)
        return done


def take_pin(store: ChunkStore, key: bytes, row: Landing | None) -> PinnedChunk | None:
    """A pin of ``key`` when its offered row (if any) is still open (which it withdraws):
    a row a transport took gets the chunk from it, never from a copy beside it."""
    if row is not None and not row.open:
        return None
    pin = store.pin(key)
    if pin is not None and row is not None:
        row.withdraw()
    return pin


def _row(rows: Sequence[Landing | None], n: int) -> Landing | None:
    """The row offered for the ``n``-th key, if any."""
    return rows[n] if n < len(rows) else None


__all__ = ["SharedLoads", "take_pin"]
