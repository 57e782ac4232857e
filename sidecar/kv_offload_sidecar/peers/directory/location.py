"""Where chunks are: a directory spread over the pool's members, one share per member.

Scheme (a rendezvous-hashed directory; Summary Cache's per-peer summaries
measured worse, see ``kv-offload bench scale``). Every chunk digest has two
*owners*: the best two members that ``ownership.OwnerTable`` picks for its bucket
among the members this sidecar is connected to (itself included). Holders tell
both owners of a digest when they gain or lose it (``publisher.Publisher``, batched
per owner every ``publish_interval_seconds``, POST ``/v1/publish``); owners
keep who holds what for their buckets (``holders.Directory``). A lookup
asks the primary owner of the first key it does not hold (POST ``/v1/locate``, or no
message when that is this sidecar; the runner-up when the primary cannot answer) and then
one holder it names; the holder's exchange says how far it holds, and the read goes on from there with the owner of
the next key (``peer_reads.PeerReads``). So:

- memory per sidecar: its own digests plus about ``2 x pool chunks / members``
  directory entries, whatever the number of members;
- background traffic per sidecar: its own changes (each to two owners) and
  the changes of others that it owns, about the same; never a pull per peer;
- a lookup of a prefix that k holders hold in turn: at most 2k + 1 messages (an
  owner question and an exchange per holder, and one question for the first key
  nobody holds), 3.0 / 5.0 / 7.0 / 9.0 for k = 1..4 in ``kv-offload bench scale``;
- a member that joins receives from each other member the digests of the
  buckets it becomes an owner of, and sends its own; the owner it pushes out of
  a bucket drops it, and the holders send that owner removes of what they hold
  there (a publish that crossed the join would stay there otherwise); one
  that leaves hands its places to the next best, to which the holders resend
  those digests. Nothing else moves, no snapshot goes to anybody.

Why two owners: two members whose views differ by one member X (X is cut
off from one of them only, an asymmetric partition) share an owner of
every bucket: X's buckets' runner-up is the other's primary. So a chunk a
third member published is found from both views. What the member that
cannot reach X holds is published to owners X's readers may not ask (about
1/N of its chunks are then missed by the others).

Staleness: a change reaches its owner within one interval (plus a round
trip). A chunk stored meanwhile is not found yet (a miss); one evicted
meanwhile is still named (the holder's exact answer makes it a miss). The
false-claim audit (``claims.py``) covers owners and holders that lie.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kv_offload_sidecar.peers.directory.holders import Directory
from kv_offload_sidecar.peers.directory.location_wire import (
    MAX_LOCATE_DIGESTS,
    HolderClaim,
    LocateQuery,
    LocateReply,
    PublishBatch,
    PublishReply,
    key_digest,
)
from kv_offload_sidecar.peers.directory.ownership import BUCKETS, OwnerTable
from kv_offload_sidecar.peers.directory.publisher import Publisher

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Share of a lookup's deadline after which the runner-up owner is asked too (a hedged request:
# a primary that hangs, cut off without an answer, costs this much instead of the deadline).
HEDGE_FRACTION = 0.25

# Sends one location message: (peer identity, "publish" | "locate", body, timeout) -> reply body.
Call = Callable[[str, str, dict[str, Any], float], Awaitable[Any]]


class Location:
    """This sidecar's part of the pool's directory, and its queries of the others' parts."""

    def __init__(self, identity: str, *, interval_seconds: float, deadline_seconds: float,
                 call: Call | None = None, metrics: SidecarMetrics | None = None) -> None:
        self.identity = identity
        self.table = OwnerTable(identity)
        self.publisher = Publisher(identity)
        self.directory = Directory()
        self._interval = interval_seconds
        self._deadline = deadline_seconds
        self._call = call
        self._metrics = metrics
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.publisher.owner_joined(identity)  # this sidecar keeps its own buckets from the start

    # ---- fed by the store and the engine path ----------------------------------------------

    def record(self, key: bytes, present: bool) -> None:
        """The store's ``on_change``: a chunk became visible or went."""
        self.publisher.record(key, present)

    def hint_chain(self, keys: Sequence[bytes], *, held: bool = False) -> None:
        """``keys`` are consecutive keys of one request (see ``Publisher.hint_chain``)."""
        self.publisher.hint_chain(keys, held=held)

    def mark_copies(self, keys: Sequence[bytes]) -> None:
        """``keys`` are being fetched from a peer: owners will name this sidecar after their holders."""
        self.publisher.mark_copies(keys)

    # ---- membership ------------------------------------------------------------------

    def member_joined(self, identity: str) -> None:
        """A peer's session is up: it owns its share of the buckets from now on."""
        if identity == self.identity or identity in self.table:
            return
        _, ousted = self.table.join(identity)
        self.publisher.owner_joined(identity, resync_me=not self.directory.has_stream(identity))
        for owner, buckets in ousted:
            if owner == self.identity:  # those entries now belong to the newcomer (the holders resend them there)
                self._drop_buckets(buckets)
            else:  # what we published there, it no longer owns (a crossing publish would stay)
                self.publisher.retract(owner, buckets.tolist())
        self._gauge()

    def member_left(self, identity: str) -> None:
        """A peer is gone: its buckets pass to their runners-up, its chunks are no longer offered."""
        if identity == self.identity or identity not in self.table:
            return
        moved = self.table.remove(identity)
        self.publisher.owner_left(identity)
        if moved.size:
            self.publisher.republish(moved.tolist())
        self.directory.purge(identity)
        self._gauge()

    def _drop_buckets(self, buckets: np.ndarray) -> None:
        mask = np.zeros(BUCKETS, dtype=bool)
        mask[buckets] = True
        self.directory.drop_buckets(mask)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.location_entries.set(len(self.directory))

    # ---- publishing ------------------------------------------------------------------

    async def run(self) -> None:
        """Publish every interval until cancelled (the sidecar's task)."""
        try:
            while True:
                await asyncio.sleep(self._interval)
                self.publish_once()
        finally:
            for t in list(self._tasks):
                t.cancel()
            for t in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def publish_once(self) -> int:
        """Hand this interval's messages to their owners (own buckets applied here); returns
        the messages started."""
        started = 0
        for owner, batches in self.publisher.take(self.table, self._busy, self.directory.has_stream):
            if owner == self.identity:
                for batch in batches:
                    self.directory.apply(self.identity, batch)
                continue
            if self._call is None:
                continue
            self._busy.add(owner)
            task = asyncio.create_task(self._deliver(owner, batches), name=f"publish {owner}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            started += len(batches)
        self._gauge()
        return started

    async def _deliver(self, owner: str, batches: list[PublishBatch]) -> None:
        assert self._call is not None
        try:
            for batch in batches:
                reply = PublishReply.from_dict(
                    await self._call(owner, "publish", batch.to_dict(), self._deadline))
                if reply.resync:
                    self.publisher.needs_reset(owner)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("publish to %s failed (%s): it gets our full share next time", owner, exc)
            self.publisher.needs_reset(owner)
        finally:
            self._busy.discard(owner)

    # ---- the owner's side --------------------------------------------------------------

    def on_publish(self, holder: str, body: Any) -> dict[str, Any]:
        """A publish from ``holder`` (an authenticated peer); ValueError for a malformed body."""
        batch = PublishBatch.from_dict(body)
        resync = self.directory.apply(holder, batch)
        if batch.resync_me and holder in self.table:
            self.publisher.wants_share(holder)
        self._gauge()
        return PublishReply(resync).to_dict()

    def on_locate(self, requester: str, body: Any) -> dict[str, Any]:
        """A locate from ``requester``; ValueError for a malformed body."""
        query = LocateQuery.from_dict(body)
        return LocateReply(self.directory.locate(query.digests, exclude=requester)).to_dict()

    # ---- the querier's side -------------------------------------------------------------

    def owner_of(self, key: bytes) -> str:
        return self.table.owner_of(key_digest(key))

    def owners_of(self, key: bytes) -> list[str]:
        return self.table.owners_of(key_digest(key))

    async def locate(self, keys: Sequence[bytes], timeout: float,
                     failed: Callable[[str, Exception], None] | None = None, *,
                     hedge_after: float | None = None) -> tuple[str, tuple[HolderClaim, ...]]:
        """``(owner that answered, holders of keys[0] best first)``: the primary owner's answer,
        or the runner-up's when the primary failed or has not answered within
        ``HEDGE_FRACTION`` of ``timeout`` (or ``hedge_after`` seconds, when sooner: the
        primary's answer silence, ``peers.liveness``; the primary's call goes on;
        ``failed(owner, error)`` hears of each owner that fails, even after the answer);
        raises when none answers."""
        digests = tuple(key_digest(k) for k in keys[:MAX_LOCATE_DIGESTS])
        owners = self.table.owners_of(digests[0])
        if owners[0] == self.identity:
            return owners[0], self.directory.locate(digests, exclude=self.identity)
        if self._call is None:
            return owners[0], ()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        asks = {self._ask(owners[0], digests, timeout, failed): owners[0]}
        hedge = min(timeout * HEDGE_FRACTION, timeout if hedge_after is None else hedge_after)
        done, _ = await asyncio.wait(asks, timeout=hedge if len(owners) > 1 else timeout)
        for t in done:
            if t.exception() is None:
                return owners[0], t.result()
        if len(owners) > 1:
            if owners[1] == self.identity:
                return owners[1], self.directory.locate(digests, exclude=self.identity)
            asks[self._ask(owners[1], digests, max(0.0, end - loop.time()), failed)] = owners[1]
        pending = {t for t in asks if not t.done()}
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, end - loop.time()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for t in done:
                if t.exception() is None:
                    return asks[t], t.result()
        errors = [t.exception() for t in asks if t.done()]
        raise errors[-1] if errors else asyncio.TimeoutError("no owner answered in time")  # type: ignore[misc]

    def _ask(self, owner: str, digests: tuple[int, ...], timeout: float,
             failed: Callable[[str, Exception], None] | None) -> asyncio.Task[tuple[HolderClaim, ...]]:
        """One locate call to ``owner``, as a task that tells ``failed`` when it fails."""
        assert self._call is not None
        call = self._call

        async def ask() -> tuple[HolderClaim, ...]:
            try:
                reply = await call(owner, "locate", LocateQuery(digests).to_dict(), timeout)
                return LocateReply.from_dict(reply).holders
            except (ConnectionError, asyncio.TimeoutError, OSError, ValueError) as exc:
                if failed is not None:
                    failed(owner, exc)
                raise

        task = asyncio.create_task(ask(), name=f"locate {owner}")
        self._tasks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        return task

    # ---- views ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"epoch": self.publisher.epoch, "keys": len(self.publisher),
                "pending": self.publisher.pending() + len(self._busy), "members": len(self.table),
                "entries": len(self.directory), "owners_per_chunk": self.table.owners_per_bucket(),
                "owned_buckets": int(self.table.buckets_of(self.identity).size)}
