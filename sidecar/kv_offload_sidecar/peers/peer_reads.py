"""The engine path's peer side: find the chunks a sidecar lacks and bring them in.

For the keys after the local prefix: ask the owner of the first one which
peers hold it (``Location.locate``: one message, none when this sidecar owns
it), then exchange with one holder (a trusted, connected one, best first):

- ``lookup(fetch=True)`` (the engine's lookup): one exchange that asks the
  holder's hit prefix and fetches its claimed run (``fetch_counted``, in the same flight: the
  chunks move one round trip after the ask); the lookup answers as soon as the count is back,
  the chunks keep arriving in the background and ``load`` waits for them.
- ``lookup(fetch=False)`` (the admin lookup, probes): the counts only.
- ``load`` without a lookup in flight: locate, then fetch.

A request's prefix may lie on several holders (a conversation whose turns ran
on different pods, each storing what it computed): where one holder's run
ends, the owner of the next key is asked and the next holder's run follows,
up to ``MAX_HOLDERS`` holders, each asked as soon as the previous count is
back. Before each holder, ``fetch_cost`` decides whether fetching its claimed
run beats the engine recomputing it; when not, the rest is a miss.

A request waits for a peer's first answer (the owner's locate, a holder's count) only while
that peer is heard from (``liveness``: it gives up after the peer's answer silence, about
50 ms at a small round trip; while the holder's data link opens, ``OPEN_ROUND_TRIPS`` of them,
and the open's own bound once it reached the holder's host; one silence per peer a request, so a
holder that left the request's owner question unanswered is judged from that question; the exchange
runs on to the fetch deadline in the background); the chunks
themselves get the fetch deadline. A holder's data connection is opened by its first
exchange (``data_links``): a member without one is asked all the same.

Every failure or deadline is a miss; a failing peer is reported for back-off
(``links.PeerManager.report_failure``), unless the exchange spanned a stall of this
sidecar's own loop (``loop_stalls``). The engine path's failures of a peer count on until
it serves an exchange again (``_unserved``; the link's own count restarts at each reconnect),
so the back-off of a peer that keeps failing requests grows (0.5, 1, 2 s caps) instead of
starting over at each reconnect; a fetch that ran out of its deadline, or whose chunks stopped
coming after the holder's count was back (the holder answered, then went silent within the
transfer: a link too slow for one chunk within the answer silence), is observed as a transfer at
the rate it managed (``PeerSpeeds.observe_cut_short``), so a slow holder is priced out
(``fetch_cost``) instead of costing each request the deadline or the silence. An owner that names a holder without
the chunk, and a holder named for a chunk it lacks, each count one false
claim (``claims.ClaimAudit``, keys ``owner:<id>`` and ``<id>``); distrusted
ones are not asked. What is done with fetched chunks once loaded is the
sidecar's sharing policy (``Sidecar.load``: dropped, or demoted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kv_offload_sidecar.peers.fetch_cost import FetchOrRecompute
from kv_offload_sidecar.peers.fetched_copies import FetchedCopies
from kv_offload_sidecar.peers.liveness import OPEN_ROUND_TRIPS, AnswerGivenUp, answer_or_silence, last_heard, pong
from kv_offload_sidecar.peers.row_landings import LandingStore, RowLandings
from kv_offload_sidecar.peers.directory.location_wire import HolderClaim

if TYPE_CHECKING:
    from kv_offload_sidecar.data.base import PeerDataClient
    from kv_offload_sidecar.loop_stalls import LoopStalls
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.peers.claims import ClaimAudit
    from kv_offload_sidecar.peers.links import PeerLink, PeerManager
    from kv_offload_sidecar.peers.directory.location import Location
    from kv_offload_sidecar.store.chunk_store import ChunkStore

log = logging.getLogger(__name__)

# Keys asked of a peer in one lookup/fetch (protocol MAX_KEYS bound).
MAX_PEER_KEYS = 65536
# Fetches started by lookups and not finished yet (past this, a lookup only counts).
MAX_PREFETCHES = 1024
# Holders one request's prefix is read from in turn (a conversation whose turns were stored
# on different pods); each costs at most an owner query and a holder exchange.
MAX_HOLDERS = 8
# Prefix of an owner's key in the claim audit.
OWNER_PREFIX = "owner:"
# Peers whose failures since they last served are remembered (the oldest forgotten first).
MAX_UNSERVED = 4096
# A fetch that failed after this share of its deadline ran out of it (a rate, not an error); so
# did one whose chunks stopped coming after the holder's count (it answered, then was too slow).
CUT_SHORT_SHARE = 0.9

T = TypeVar("T")


@dataclass
class _Prefetch:
    """A fetch a lookup started, awaited by the load that follows."""

    # The keys asked (the lookup's keys after the local prefix).
    keys: list[bytes]
    # The holder's hit prefix, once its LOOKUP answer is back.
    count: asyncio.Future[int]
    # The exchange itself (resolves to the chunks fetched).
    task: asyncio.Task[int] | None = None
    # The holder asked, and when it was first asked as the chunks' owner and left that unanswered.
    holder: str = ""
    silent_since: float | None = None


class PeerReads:
    """Lookups and loads of chunks this sidecar lacks, from the peers the directory names."""

    def __init__(self, *, location: Location, peers: PeerManager, claims: ClaimAudit,
                 metrics: SidecarMetrics, store: Callable[[], ChunkStore], deadline_seconds: float,
                 cost: FetchOrRecompute, stalls: LoopStalls, landings: RowLandings | None = None) -> None:
        # Fetch or recompute, from the peers' measured speeds and the engine's prefill rate.
        self.cost = cost
        # This sidecar's own stalls: a failure across one is not the peer's.
        self._stalls = stalls
        self._location = location
        self._peers = peers
        self._claims = claims
        self._metrics = metrics
        self._store = store
        self._deadline = deadline_seconds
        # Rows of vLLM's that load jobs offer to the chunks they wait for (fetches may land there).
        self._landings = landings
        self._inflight: dict[bytes, _Prefetch] = {}
        # Fetched chunks not loaded yet.
        self._fetched = FetchedCopies()
        # Owners a ping beside a question is in flight to (``liveness.pong``).
        self._pinging: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Peer identity -> exchanges failed (its fault) since it last served one.
        self._unserved: dict[str, int] = {}

    @property
    def fetches_in_flight(self) -> int:
        """Fetches lookups started whose exchanges have not all ended (landed, failed or past
        their deadline)."""
        return len(self._inflight)

    # ---- engine operations ---------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes], local: int, timeout: float, *, fetch: bool) -> int:
        """Peer hit prefix of ``keys[local:]`` (the first ``local`` are held here); with ``fetch``
        the chunks start coming."""
        asked_at = asyncio.get_running_loop().time()
        deadline = min(timeout, self._deadline)
        found = self._pending(keys, local)
        if found is not None:
            start, pending = found
            return max(0, await self._count_of(pending, keys[start:], deadline) - (local - start))
        rest = list(keys[local:local + MAX_PEER_KEYS])
        if not fetch or len(self._inflight) >= MAX_PREFETCHES:
            return await self._count_runs(rest, deadline)
        asked = time.monotonic()
        holder = await self._holder(rest, deadline, decide=True)
        if holder is None:
            return 0
        prefetch = _Prefetch(rest, asyncio.get_running_loop().create_future(), holder=holder[1].identity,
                             silent_since=self._silent_since(rest, holder, asked))
        self._inflight[rest[0]] = prefetch
        prefetch.task = self._spawn(self._prefetch(prefetch, holder, asked_at))
        return await self._count_of(prefetch, rest, deadline)

    async def load(self, keys: Sequence[bytes], local: int, timeout: float) -> None:
        """Make ``keys[local:]`` local as far as the pool has them (the first ``local`` are)."""
        found = self._pending(keys, local)
        if found is not None and found[1].task is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(found[1].task)
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + min(timeout, self._deadline)
        rest = list(keys[local:local + MAX_PEER_KEYS])
        for _ in range(MAX_HOLDERS):
            holder = await self._holder(rest, end - loop.time(), decide=True)
            if holder is None:
                return
            got = await self._exchange(*holder, rest, end - loop.time(), fetch=True)
            rest = self._after_run(rest, got)
            if not rest:
                return

    async def prefix_holders(self, keys: Sequence[bytes], timeout: float) -> list[tuple[PeerLink, int]]:
        """Peers holding a prefix of ``keys``, each with its length as the peer counts it: the
        holders the owner of ``keys[0]`` names, asked in parallel (nothing moves). For routing
        hints: one owner question and up to LOCATE_HOLDERS counts."""
        loop = asyncio.get_running_loop()
        end = loop.time() + min(timeout, self._deadline)
        rest = list(keys[:MAX_PEER_KEYS])
        found = await self._candidates(rest, end - loop.time(), hint=True) if rest else None
        if found is None:
            return []
        owner, asked = found
        counts = await asyncio.gather(*(self._answer(
            self._exchange(link, claim, owner, rest, end - loop.time(), fetch=False, hint=True),
            claim.identity, end - loop.time(), 0) for link, claim in asked))
        return sorted(((link, n) for (link, _), n in zip(asked, counts) if n > 0), key=lambda x: -x[1])

    def _pending(self, keys: Sequence[bytes], local: int) -> tuple[int, _Prefetch] | None:
        """A lookup's fetch still running for these keys: ``(index of its first key, it)``.
        It started at the first key not held then, which is at or before ``local`` now."""
        for i in range(min(local, len(keys) - 1), -1, -1):
            pending = self._inflight.get(keys[i])
            if pending is not None:
                return i, pending
        return None

    def take_fetched(self, keys: Sequence[bytes]) -> list[bytes]:
        """Which of ``keys`` came from peers (the caller drops or demotes them once loaded)."""
        return self._fetched.take(keys)

    def take_unloaded(self, older_than: float) -> list[bytes]:
        """Fetched chunks no load took within ``older_than`` seconds (a lookup whose request the
        engine never loaded: preempted, aborted); the caller drops or demotes them too."""
        return self._fetched.take_older_than(older_than)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # ---- steps ----------------------------------------------------------------------------

    async def _holder(self, keys: list[bytes], deadline: float, *,
                      decide: bool = False) -> tuple[PeerLink, HolderClaim, str] | None:
        """Ask the owner of ``keys[0]``; the first trusted member holder it names (and the owner).
        With ``decide``, None also when fetching the holder's claimed run would be slower than
        the engine recomputing it (``fetch_cost``)."""
        found = await self._candidates(keys, deadline)
        if found is None or not found[1]:
            return None
        owner, ((link, claim), *_) = found
        if decide:
            worth = self.cost.worth(claim.identity, min(claim.run, len(keys)))
            self._metrics.fetch_decisions.labels(decision="fetch" if worth else "recompute").inc()
            if not worth:
                return None
        return link, claim, owner

    def _silent_since(self, keys: list[bytes], holder: tuple[PeerLink, HolderClaim, str],
                      asked: float) -> float | None:
        """``asked`` when the holder is the chunks' primary owner and the runner-up answered for it
        (it was silent or failed): unless heard from after that question (the pong of the ping
        beside it, ``liveness.pong``), its silence counts from there, not again from its own."""
        return asked if holder[1].identity == self._location.owner_of(keys[0]) != holder[2] else None

    async def _candidates(self, keys: list[bytes], deadline: float, *,
                          hint: bool = False) -> tuple[str, list[tuple[PeerLink, HolderClaim]]] | None:
        """``(owner asked, the trusted member holders it names, best first)``; None when the
        owner is distrusted or cannot answer (an engine path's failing owner is backed off).
        The question counts in ``lookup_messages``, or with ``hint`` in ``route_hint_messages``."""
        if deadline <= 0:
            return None
        owner = self._location.owner_of(keys[0])
        distrusted = self._claims.distrusted()
        if OWNER_PREFIX + owner in distrusted:
            return None
        if owner != self._location.identity:
            if hint:
                self._metrics.route_hint_messages.labels(kind="locate").inc()
            else:
                self._metrics.lookup_messages.inc()
        started = asyncio.get_running_loop().time()

        def failed(asked: str, exc: Exception) -> None:
            log.warning("owner %s could not say where chunks are (%s)", asked, exc)
            link = self._peers.connected(asked)
            if link is not None and not hint:
                self._blame(link, f"locate: {exc}", started)

        # The runner-up is asked once the primary has been silent for its answer silence.
        primary = self._peers.connected(owner)
        hedge = primary.round_trips.answer_silence(deadline) if primary is not None else None
        if primary is not None and primary.data is not None and owner not in self._pinging:
            self._pinging.add(owner)  # its pong shows a slow owner alive (``_silent_since``)
            ping = self._spawn(pong(primary.data, primary.round_trips))
            ping.add_done_callback(lambda _, asked=owner: self._pinging.discard(asked))
        try:
            owner, holders = await self._location.locate(keys, deadline, failed, hedge_after=hedge)
        except (ConnectionError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.warning("no owner could say where chunks are (%s); %s", exc, "no routing hint" if hint else "a miss")
            return None
        out = []
        for claim in holders:
            if claim.identity in distrusted or claim.identity == self._location.identity:
                continue
            link = self._peers.connected(claim.identity)  # its data link opens on demand
            if link is not None:
                out.append((link, claim))
        return owner, out

    async def _prefetch(self, prefetch: _Prefetch, holder: tuple[PeerLink, HolderClaim, str],
                        asked_at: float) -> int:
        """The lookup's fetch: the first holder's run, then the next holders' runs of the same
        request (a chain whose parts were stored on different pods), each asked as soon as the
        previous count is back while its chunks still arrive. The count is the whole run.
        A fetch that brought chunks is timed from the lookup (``asked_at``, the loop's time) to
        its last chunk landed and verified: the engine's load phase ``lookup_to_landed``
        (much of the transfer happens before the load asks for it)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._deadline
        keys, total = prefetch.keys, 0
        exchanges: list[asyncio.Task[int]] = []
        try:
            for _ in range(MAX_HOLDERS):
                counted: asyncio.Future[int] = loop.create_future()
                exchanges.append(self._spawn(self._exchange(
                    *holder, keys, end - loop.time(), fetch=True,
                    on_count=lambda n, f=counted: _resolve(f, n))))
                await asyncio.wait({counted, exchanges[-1]}, return_when=asyncio.FIRST_COMPLETED)
                n = counted.result() if counted.done() else 0
                rest = self._after_run(keys, n)
                total += len(keys) - len(rest)
                if n == 0 or not rest:
                    break
                keys = rest
                found = await self._holder(keys, end - loop.time(), decide=True)
                if found is None:
                    break
                holder = found
            _resolve(prefetch.count, total)
            got = 0
            for t in exchanges:
                got += await t
            if got:
                self._metrics.engine_transfer.labels(op="load", phase="lookup_to_landed").observe(
                    loop.time() - asked_at)
            return got
        finally:
            _resolve(prefetch.count, total)
            self._inflight.pop(prefetch.keys[0], None)

    async def _count_runs(self, keys: list[bytes], deadline: float) -> int:
        """The pool's hit prefix of ``keys`` by counts alone (nothing moves)."""
        loop = asyncio.get_running_loop()
        end, total = loop.time() + deadline, 0
        for _ in range(MAX_HOLDERS):
            asked = time.monotonic()
            holder = await self._holder(keys, end - loop.time())
            if holder is None:
                break
            n = await self._answer(self._exchange(*holder, keys, end - loop.time(), fetch=False),
                                   holder[1].identity, end - loop.time(), 0,
                                   since=self._silent_since(keys, holder, asked))
            rest = self._after_run(keys, n)
            total += len(keys) - len(rest)
            if n == 0 or not rest:
                break
            keys = rest
        return total

    def _after_run(self, keys: list[bytes], n: int) -> list[bytes]:
        """``keys`` past a holder's run of ``n`` and past the chunks this store holds after it."""
        if n <= 0:
            return keys
        store = self._store()
        i = n
        while i < len(keys) and store.contains(keys[i]):
            i += 1
        return keys[i:]

    async def _exchange(self, link: PeerLink, claim: HolderClaim, owner: str, keys: list[bytes],
                        deadline: float, *, fetch: bool, on_count: Callable[[int], None] | None = None,
                        hint: bool = False) -> int:
        """One exchange with the holder (a count, a fetch, or both; ``hint``: a routing hint's
        count); 0 on any failure. Its timing feeds the peer's moving averages
        (``fetch_cost.PeerSpeeds``)."""
        from kv_offload_sidecar.data import ReceiveStopped, TransportError
        from kv_offload_sidecar.peers.data_links import DataLinkUnavailable

        if deadline <= 0:
            return 0
        if hint:
            self._metrics.route_hint_messages.labels(kind="count").inc()
        else:
            self._metrics.lookup_messages.inc()
        if fetch:  # marked before they land: a load may pin them before this returns
            self._location.mark_copies(keys)
            self._fetched.remember(keys)
        loop = asyncio.get_running_loop()
        started = counted_at = loop.time()
        speeds = self.cost.speeds
        asked = len(keys)  # past the holder's count, the keys are the next holder's

        def counted(n: int) -> None:
            nonlocal counted_at, asked
            counted_at, asked = loop.time(), n
            if fetch:
                self._fetched.forget(keys[n:])  # not coming from this holder
            speeds.observe_latency(claim.identity, counted_at - started)
            if on_count is not None:
                on_count(n)

        got = 0
        try:
            # The data link opens now if need be (``data_links``), within this deadline.
            async with self._peers.data_links.acquire(link, deadline) as data:
                opened = loop.time()  # the holder's speeds are timed from here, past the open
                deadline, started, counted_at = deadline - (opened - started), opened, opened
                if not fetch:
                    coro = data.lookup(keys, deadline)
                elif on_count is not None:  # the claimed run (up to the fetch's window) goes out with
                    # the LOOKUP: bytes move after one round trip; a stale claim costs a window's slots.
                    coro = data.fetch_counted(keys, self._fetch_store(data), deadline,
                                              first=max(1, claim.run), on_count=counted)
                else:
                    coro = data.fetch(keys, self._fetch_store(data), deadline)
                # The transport enforces the deadline; this bound only guards against a hang.
                async with asyncio.timeout(deadline + 1.0):
                    got = int(await coro)
        except DataLinkUnavailable as exc:  # its open, if it failed, reported the peer
            log.info("peer %s: no data link (%s); a miss", claim.identity, exc)
            return 0
        except ReceiveStopped as exc:  # a load job of ours ended mid-chunk: the link reconnects
            log.info("peer %s fetch stopped: %s", claim.identity, exc)
            self._peers.report_failure(link, str(exc), peer_at_fault=False)
            return 0
        except (TransportError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.warning("peer %s %s failed: %s; a miss", claim.identity, "fetch" if fetch else "lookup", exc)
            if fetch and (counted_at > started or loop.time() - started >= CUT_SHORT_SHARE * deadline):
                landed = sum(1 for k in keys[:asked] if self._store().contains(k))
                speeds.observe_cut_short(claim.identity, landed * self._store().slot_bytes,
                                         loop.time() - counted_at, self._store().slot_bytes)
            self._blame(link, f"{'fetch' if fetch else 'lookup'}: {exc}", started)
            return 0
        finally:
            if fetch:
                self._forget_unlanded(keys[got:max(got, asked)])
        if not fetch:
            speeds.observe_latency(claim.identity, loop.time() - started)
        elif got:
            speeds.observe_transfer(claim.identity, got * self._store().slot_bytes, loop.time() - counted_at)
        if got or not fetch:
            self._unserved.pop(claim.identity, None)
        backed = 1 if got else 0
        self._claims.record(claim.identity, 1, backed)
        if owner != self._location.identity:
            self._claims.record(OWNER_PREFIX + owner, 1, backed)
        return got

    async def _answer(self, work: Awaitable[T], identity: str, deadline: float, default: T, *,
                      since: float | None = None) -> T:
        """``work``'s result, waited for while the peer ``identity`` is heard from (``heard``: its
        data link's last frame; ``liveness.answer_or_silence``, from ``since`` with one open),
        ``deadline`` seconds at most; else ``default``, a miss counted in ``peer_answers_given_up``,
        while ``work`` runs on to its own deadline in the background (its failure is blamed there)."""
        fut = work if isinstance(work, asyncio.Future) else self._spawn(work)
        link = self._peers.connected(identity)
        silence = link.round_trips.answer_silence(deadline) if link is not None else deadline
        if link is not None and link.data is None:  # its data link opens first: a few more round trips
            silence = min(deadline, OPEN_ROUND_TRIPS * silence)
        heard = (lambda: last_heard(link)) if link is not None else float
        try:
            return await answer_or_silence(fut, heard, silence, deadline,
                                           since if link is not None and link.data is not None else None)
        except AnswerGivenUp as gave_up:
            self._metrics.peer_answers_given_up.labels(reason=gave_up.reason).inc()
            if gave_up.reason == "silence":  # its heartbeat decides whether it is lost
                log.info("peer %s silent for %.0f ms: a miss", identity, silence * 1e3)
            return default

    def _fetch_store(self, client: PeerDataClient) -> ChunkStore | LandingStore:
        """The store a fetch lands in: with the rows load jobs offer, where the plane can use them."""
        store = self._store()
        if self._landings is None or not client.receives_into_offered_rows:
            return store
        return LandingStore(store, self._landings, self._metrics)

    def _blame(self, link: PeerLink, error: str, started: float) -> None:
        """Report a failed exchange; the peer is backed off unless this sidecar itself
        stalled during it (``loop_stalls``)."""
        at_fault = not self._stalls.excuse(started)
        if not at_fault:
            log.warning("peer %s is not backed off: this sidecar itself stalled during the exchange; "
                        "its link reconnects now", link.identity)
        elif link.identity is not None:  # the back-off goes on from the failures before the reconnect
            n = self._unserved[link.identity] = self._unserved.pop(link.identity, 0) + 1
            if len(self._unserved) > MAX_UNSERVED:
                del self._unserved[next(iter(self._unserved))]
            link.failures = max(link.failures, n - 1)
        self._peers.report_failure(link, error, peer_at_fault=at_fault)

    async def _count_of(self, prefetch: _Prefetch, keys: Sequence[bytes], deadline: float) -> int:
        """The prefetch's count, as far as it covers ``keys``; 0 past ``deadline`` or once the
        holder was silent for its answer silence."""
        n = await self._answer(prefetch.count, prefetch.holder, deadline, 0, since=prefetch.silent_since)
        same = 0
        for a, b in zip(prefetch.keys[:n], keys):
            if a != b:
                break
            same += 1
        return same

    def _forget_unlanded(self, keys: list[bytes]) -> None:
        """Forget the ``keys`` an exchange did not bring, keeping those that landed: a load
        that took its last chunk cancels the exchange before it counts them, and they are
        still copies the load must drop (or demote) once released."""
        try:
            store = self._store()
        except RuntimeError:  # stopping: nothing is loaded any more
            store = None
        self._fetched.forget(k for k in keys if store is None or not store.contains(k))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _resolve(fut: asyncio.Future[int], n: int) -> None:
    if not fut.done():
        fut.set_result(n)
