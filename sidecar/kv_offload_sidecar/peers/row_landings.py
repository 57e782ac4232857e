"""Rows of vLLM's primary region offered to the peer chunks a load job is waiting for.

A ``load_rows`` job knows each key's row before its chunk is here; most of a peer hit's
bytes are still on the wire when the job comes (the lookup started the fetch a few
scheduler steps earlier). The job offers the rows of the keys its sidecar lacks
(``RowLandings.offer``). A transport that decides where a chunk's bytes go at its first
byte (TCP: at the chunk frame's header) asks its reservation (``LandingReservation.
receive_view``) and receives straight into the offered row instead of the store slot it
reserved, so the sidecar does not copy the chunk a second time. Where both pods' sidecars
shared one core (``bench vllm`` here), that copy took a tcp peer fetch of 512 MiB from
about raw TCP's time to 1.35-1.7x it. UCX and NIXL place their reads when they request
a chunk, before the job's rows are known, and do not take offers.

Contract:
- A chunk in a row is verified like one in a slot (its checksum over the row's bytes)
  before its offer counts as landed; one that fails is never loaded (the job's loaded
  prefix ends before it, vLLM recomputes it) and counts as an integrity failure.
- The store does not get a chunk that landed in a row: the pool keeps it at its holder,
  as ``--peer-copies drop`` would have dropped it after the load anyway (under ``cold`` no
  row is offered, so fetched chunks stay). Unless another load of this pod waits for the
  key without a row of its own (``RowLandings.wait``: two ranks loading one system prompt,
  one fetch shared, ``shared_loads``): the chunk is then copied from the row into its slot
  too and committed there, verified over the slot's bytes; and a load that comes once the
  chunk is in another job's row copies it from there into the store (``RowLandings.share``)
  while that job still holds the row (all on the event loop).
- Only the rows a job names are written, and only while the job runs: its offers are
  withdrawn when it ends (answered, past its deadline or cancelled); an offer taken and
  still receiving is stopped then (``Landing.withdraw`` revokes the transfer's write gate,
  which returns once no write into the row is under way, then calls the transport's
  ``stop``, which ends the connection, so nothing writes into the row after the job answered).
- A row is written only before its job's deadline, whatever the event loop is doing: the
  transfer that takes it writes under a ``data.write_gates.WriteGate`` whose deadline is the
  job's when that comes first (``Landing.take``), checked by the writing thread itself before
  each piece; vLLM reuses the row once its tier gives up at that deadline, even when this
  sidecar's loop is too late to withdraw the offer.
- One offer per key at a time; the slot reserved for the chunk stays reserved until the
  chunk is verified (the fetch window's back-pressure is unchanged) and is then freed.
- Threads: a transport may take a row, verify and commit its chunk on its connection's own
  thread (TCP lanes do, so the lanes' per-chunk steps do not queue on the event loop); offers
  are made and withdrawn on the loop. Each ``Landing``'s state changes under its own lock, so a
  withdrawal and a commit exclude each other: whichever comes first decides. A chunk is
  marked landed only while its row is still offered (a commit that lost the race is refused:
  ``CommitRefused``, the row is not counted), the copy into a waiting load's slot reads the
  row only while it is, and a withdrawal stops the transfer after the lock is left (its stop
  waits for the thread, never the other way round). ``RowLandings``' own bookkeeping (the
  landed wake-up, the offers by key) stays on the loop: a thread's finish is handed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kv_offload_sidecar.store.checksum import chunk_checksum

if TYPE_CHECKING:
    from kv_offload_sidecar.data.base import ReservationLike
    from kv_offload_sidecar.data.write_gates import WriteGate
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.store.chunk_store import ChunkStore


class LandingState(enum.Enum):
    """Where an offered row stands."""

    OFFERED = "offered"  # no transport took it (yet)
    RECEIVING = "receiving"  # a transport is receiving the chunk into the row
    LANDED = "landed"  # the whole chunk is in the row, verified
    FAILED = "failed"  # taken, but the chunk did not land whole and verified
    WITHDRAWN = "withdrawn"  # the job ended before a transport took it


class Landing:
    """One row offered for one key's chunk."""

    def __init__(self, key: bytes, view: memoryview, on_end: Callable[[Landing], None],
                 deadline: float = math.inf) -> None:
        # The key whose chunk the row waits for.
        self.key = key
        # The row's chunk bytes (writable; valid while the job holds the region).
        self.view = view
        # The job's deadline (time.monotonic()): no write into the row starts after it.
        self.deadline = deadline
        # Where the offer stands.
        self.state = LandingState.OFFERED
        # The verified checksum of the chunk in the row, once landed.
        self.checksum: int | None = None
        # Called (on the committing thread) once the chunk in the row is verified, right before
        # its commit reads the row or marks it landed: a test drives a withdrawal in there.
        self.before_landing: Callable[[], None] | None = None
        self._on_end = on_end
        self._stop: Callable[[], None] | None = None
        self._gate: WriteGate | None = None
        # Held around every change of ``state`` (a transport's thread and the loop).
        self._lock = threading.Lock()
        try:  # where ``on_end`` runs when a transport's thread finishes the row
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def take(self, stop: Callable[[], None], gate: WriteGate | None = None) -> memoryview | None:
        """The row to receive into, or None when the offer is not open or its job's deadline
        is too near. ``stop``: what ends the receiving should the job end first (it must stop
        every write into the row); ``gate``: the transfer's write gate, which every write into
        the row must hold (``write_gates``): brought forward to the job's deadline here, and
        revoked when the job ends."""
        with self._lock:
            if self.state is not LandingState.OFFERED:
                return None
            if gate is not None:
                if not gate.open(self.deadline):
                    return None  # the slot, then: no row is taken that could not be written in time
                gate.tighten(self.deadline)
            self.state, self._stop, self._gate = LandingState.RECEIVING, stop, gate
            return self.view

    def copy_while_receiving(self, target: memoryview) -> bool:
        """(Any thread.) Copy the row into ``target`` unless its job ended (the row is read
        only while it is still offered); True when copied."""
        with self._lock:
            if self.state is not LandingState.RECEIVING:
                return False
            target[:] = self.view
            return True

    def finish(self, ok: bool, checksum: int | None = None) -> bool:
        """(Any thread.) The transport is done with the row: the chunk is whole and verified
        (``ok``, with its ``checksum``), or not. False when the job withdrew the row first
        (nothing changes then)."""
        with self._lock:
            if self.state is not LandingState.RECEIVING:
                return False
            if ok:
                self.checksum = checksum
            self.state = LandingState.LANDED if ok else LandingState.FAILED
            self._stop = None
        self._ended()
        return True

    def withdraw(self) -> None:
        """(On the loop.) The job ends (or took the chunk from the store): no transport may
        start on the row, and one still receiving is stopped now."""
        with self._lock:
            stop, gate, state = self._stop, self._gate, self.state
            if state is LandingState.OFFERED:
                self.state = LandingState.WITHDRAWN
            elif state is LandingState.RECEIVING:
                self.state = LandingState.FAILED
                self._stop = self._gate = None
            else:
                return
        if state is LandingState.RECEIVING and gate is not None:
            gate.revoke()  # no write into the row is under way now, and none starts
        self._on_end(self)
        if state is LandingState.RECEIVING and stop is not None:
            stop()

    def _ended(self) -> None:
        """``on_end``, on the loop: now when called there, else handed to it."""
        loop = self._loop
        try:
            here = loop is None or asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self._on_end(self)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for the row
            loop.call_soon_threadsafe(self._on_end, self)  # type: ignore[union-attr]

    @property
    def open(self) -> bool:
        """No transport took the row yet."""
        return self.state is LandingState.OFFERED

    @property
    def landed(self) -> bool:
        return self.state is LandingState.LANDED


class RowLandings:
    """The rows offered now, by key (one sidecar; used on its event loop, but for a transport
    thread's ``landing`` and ``wanted``, dictionary reads)."""

    def __init__(self, on_landed: Callable[[], None]) -> None:
        # Called whenever a chunk landed in its row, verified (wakes the job waiting for it).
        self._on_landed = on_landed
        self._offers: dict[bytes, Landing] = {}
        # Key -> loads waiting for it without a row of their own offered for it.
        self._waiting: dict[bytes, int] = {}

    def offer(self, key: bytes, view: memoryview, deadline: float = math.inf) -> Landing | None:
        """Offer ``view`` (a row's chunk bytes) for ``key``'s chunk until ``deadline`` (the job's,
        a time.monotonic() value); None when the key is offered already (that job keeps it;
        this one takes the chunk from the store)."""
        if key in self._offers:
            return None
        landing = Landing(key, view, self._ended, deadline)
        self._offers[key] = landing
        return landing

    def landing(self, key: bytes) -> Landing | None:
        """The offer for ``key`` while its job runs."""
        return self._offers.get(key)

    def __len__(self) -> int:
        return len(self._offers)

    def wait(self, keys: Sequence[bytes]) -> None:
        """A load waits for ``keys`` without rows of its own for them: a chunk that lands in
        another job's row is committed to the store as well (until ``unwait``)."""
        for key in keys:
            self._waiting[key] = self._waiting.get(key, 0) + 1

    def unwait(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            n = self._waiting.get(key, 0) - 1
            if n > 0:
                self._waiting[key] = n
            else:
                self._waiting.pop(key, None)

    def wanted(self, key: bytes) -> bool:
        """A load without a row of its own waits for ``key``."""
        return key in self._waiting

    def share(self, key: bytes, store: ChunkStore) -> bool:
        """Copy ``key``'s chunk from the row it landed in (another job's, still running) into
        ``store``, verified over the slot against the row's checksum; False when no row holds
        it landed or no slot is free."""
        landing = self._offers.get(key)
        if landing is None or not landing.landed or landing.checksum is None:
            return False
        slot = store.begin_write(key)
        if slot is None:
            return False
        slot.view[:] = landing.view
        return slot.commit(landing.checksum)

    def _ended(self, landing: Landing) -> None:
        if landing.state is LandingState.LANDED:
            self._on_landed()
            return  # stays until its job withdraws it: contains() answers from it
        if self._offers.get(landing.key) is landing:
            del self._offers[landing.key]

    def release(self, landings: Sequence[Landing | None]) -> None:
        """A job's offers end with it: withdrawn, a receive still running stopped."""
        for landing in landings:
            if landing is None:
                continue
            landing.withdraw()
            if self._offers.get(landing.key) is landing:
                del self._offers[landing.key]


class LandingReservation:
    """A store slot reserved for a fetched chunk that may land in an offered row instead."""

    def __init__(self, slot: ReservationLike, store: ChunkStore, landings: RowLandings,
                 metrics: SidecarMetrics | None) -> None:
        self.key = slot.key
        # The slot's view and index (what the transports that place their reads when they
        # request a chunk use: UCX, NIXL).
        self.view = slot.view
        self.slot = getattr(slot, "slot", None)
        self._slot = slot
        self._store = store
        self._landings = landings
        self._metrics = metrics
        self._row: Landing | None = None
        # Why the last commit failed for a reason of this side's (see WriteReservation.refused).
        self.refused: str | None = None

    def receive_view(self, stop: Callable[[], None], gate: WriteGate | None = None) -> memoryview:
        """Where the chunk's bytes go, decided now (at the chunk's first byte): an offered row,
        else the slot. ``stop``, ``gate``: end the receiving, and every write (see ``Landing.take``)."""
        if self._row is None:
            landing = self._landings.landing(self.key)
            if landing is not None and landing.take(stop, gate) is not None:
                self._row = landing
                return landing.view
        return self.view if self._row is None else self._row.view

    def commit(self, expected_checksum: int | None = None, *,
               computed_checksum: int | None = None) -> bool:
        """The slot's commit; for a chunk in a row: verify it there and free the slot (or, when
        another load waits for the key without a row, copy it into the slot and commit that)."""
        row = self._row
        if row is None:
            ok = self._slot.commit(expected_checksum, computed_checksum=computed_checksum)
            self.refused = getattr(self._slot, "refused", None)
            return ok
        if row.state is not LandingState.RECEIVING:
            return self._refuse()  # the job ended meanwhile: nothing trustworthy landed
        checksum = chunk_checksum(row.view) if computed_checksum is None else computed_checksum
        ok = expected_checksum is None or checksum == expected_checksum
        if row.before_landing is not None:
            row.before_landing()
        if ok and self._landings.wanted(self.key) and row.copy_while_receiving(self._slot.view):
            self._slot.commit(checksum)  # hashed again over the slot
        else:
            self._slot.abort()
        if not ok:
            self._store.count_integrity_failure()
            row.finish(False)
            return False
        if not row.finish(True, checksum):  # withdrawn since: the job does not get it
            return self._refuse()
        if self._metrics is not None:
            self._metrics.peer_chunks_into_rows.inc()
        return True

    def _refuse(self) -> bool:
        self._slot.abort()
        self.refused = "its row's load job had already ended"
        return False

    def abort(self) -> None:
        self._slot.abort()
        if self._row is not None:
            self._row.finish(False)


class LandingStore:
    """The store as a fetch sees it, with offered rows: reservations that may land in a row,
    and a chunk that landed in its row counts as present."""

    def __init__(self, store: ChunkStore, landings: RowLandings,
                 metrics: SidecarMetrics | None = None) -> None:
        self._store = store
        self._landings = landings
        self._metrics = metrics

    @property
    def slot_bytes(self) -> int:
        return self._store.slot_bytes

    def contains(self, key: bytes) -> bool:
        if self._store.contains(key):
            return True
        landing = self._landings.landing(key)
        return landing is not None and landing.landed

    def lookup_prefix(self, keys: Sequence[bytes], *, touch: bool = True) -> int:
        return self._store.lookup_prefix(keys, touch=touch)

    def begin_write(self, key: bytes) -> LandingReservation | None:
        slot = self._store.begin_write(key)
        return None if slot is None else LandingReservation(slot, self._store, self._landings,
                                                            self._metrics)

    def pin(self, key: bytes):  # noqa: ANN201 (the store's PinnedChunk)
        return self._store.pin(key)


__all__ = ["Landing", "LandingReservation", "LandingState", "LandingStore", "RowLandings"]
