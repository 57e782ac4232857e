"""The NIXL data-plane client: chunks READ from the holder's slot straight into a reserved slot.

The connection is the TCP client's (lookups, FETCH, authentication) plus the holder's sealed
metadata, loaded into every lane's agent. A FETCH is answered with CHUNK_AT frames; each
offered chunk becomes a read job on the least busy lane, which READs it into the
reservation's slot as one transfer and then hashes the slot in one call. The loop then
commits the slot with that checksum against the holder's (a mismatch is an IntegrityError
and nothing is stored) and RELEASEs the request id, batched into the next message. A slot
a lane may still write into is never handed back early: its reservation's abort waits for
the lane (``_GuardedReservation``). Any failed read closes the connection.

A read job starts only while its chunk's write gate is open (``write_gates``: before the
fetch's deadline, and not given up), checked on the lane itself: a loop that is late does not
let queued reads land after the deadline. A READ is one call per chunk, so one started just
before the deadline may end after it, into a slot still reserved (its abort waits, above).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import StoreLike, TransportError
from kv_offload_sidecar.data.fetch import PendingChunk, commit_received, run_fetch
from kv_offload_sidecar.data.nixl.frames import ExportedView, decode_chunk_at, decode_metadata, encode_release
from kv_offload_sidecar.data.nixl.runtime import Lane, LaneError, NixlRuntime, SlotTable
from kv_offload_sidecar.data.tcp.client import TcpPeerDataClient
from kv_offload_sidecar.data.tcp.sockets import read_frame
from kv_offload_sidecar.data.write_gates import LateWrite

if TYPE_CHECKING:
    from kv_offload_sidecar.data.tcp.sockets import DataStream
    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Chunks a NIXL fetch keeps requested or being read (at least).
NIXL_WINDOW = 16
# Seconds a failed fetch waits for its lanes to finish the reads they started (a slot is
# handed back only once no lane writes into it).
READ_DRAIN_SECONDS = 5.0


class _GuardedReservation:
    """A reservation whose slot a lane may be writing: ``abort`` waits until the lane is done."""

    def __init__(self, reservation: Any) -> None:
        self._res = reservation
        self.key = reservation.key
        self.view = reservation.view
        self.slot = reservation.slot
        # True from the read job's submission until the loop learns the lane finished.
        self.reading = False
        self._abort_wanted = False

    @property
    def refused(self) -> str | None:
        """Why the last commit failed for a reason of this side's (``data.base.commit_failure``)."""
        return getattr(self._res, "refused", None)

    def commit(self, expected_checksum: int | None = None, *, computed_checksum: int | None = None) -> bool:
        return self._res.commit(expected_checksum, computed_checksum=computed_checksum)

    def abort(self) -> None:
        if self.reading:
            self._abort_wanted = True  # the lane still writes into the slot: free it afterwards
        else:
            self._res.abort()

    def read_finished(self) -> None:
        self.reading = False
        if self._abort_wanted:
            self._res.abort()


class _Remote:
    """The holder as this connection knows it: its view and the lanes that loaded it."""

    def __init__(self, view: ExportedView, names: list[str], tables: list[SlotTable]) -> None:
        self.view = view
        # Agent name per lane (the same holder agent, loaded into each lane's agent).
        self.names = names
        # The view's slot table per lane.
        self.tables = tables


class NixlPeerDataClient(TcpPeerDataClient):
    """An authenticated connection to a peer whose chunks this process READs with NIXL."""

    # Whether lanes hash what they read; False only for `kv-offload bench transport`'s
    # nixl_unverified row (the sidecar never changes it).
    verify = True
    # Its reads into registered store slots are placed when requested.
    receives_into_offered_rows = False

    def __init__(self, stream: DataStream, metrics: SidecarMetrics | None, window: int) -> None:
        super().__init__(stream, metrics, max(window, NIXL_WINDOW))
        self._remote: _Remote | None = None
        self._runtime: NixlRuntime | None = None
        self._local_tables: list[SlotTable] = []
        self._local_store: Any = None
        # Request id -> chunk whose READ is queued or running on a lane.
        self._reading: dict[int, PendingChunk] = {}
        # Request ids read (or failed) whose pins the holder may drop.
        self._releases: list[int] = []
        self._release_scheduled = False
        # Fetches running on this connection (their FETCH frames carry the pending RELEASEs).
        self._fetching = 0
        # Set while no read of this connection is queued or running.
        self._no_reads = asyncio.Event()
        self._no_reads.set()
        # Finished reads handed over by the lanes; the loop is woken once per batch.
        self._finished: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake_pending = False
        self._wake_lock = threading.Lock()

    @property
    def lanes(self) -> int:
        """This process's read lanes, each reading and hashing chunks on its own thread (the
        reads are one-sided: the holder's cores take no part, so its offer does not count)."""
        return len(self._runtime.lanes) if self._runtime is not None else 1

    @classmethod
    async def _after_auth(cls, stream: DataStream, session_key: bytes, nonce: bytes,
                          metrics: SidecarMetrics | None) -> object:
        """Read the holder's sealed metadata and load it into every lane (wire-up starts)."""
        header, payload = await read_frame(stream, bytearray(proto.HEADER_BYTES))
        if header.type is proto.MessageType.ERROR:
            raise TransportError(f"peer refused: {proto.decode_error(payload or b'')}")
        if header.type is not proto.MessageType.NIXL_METADATA or payload is None:
            raise proto.ProtocolError("malformed", f"expected NIXL_METADATA, got {header.type.name} "
                                      "(is the peer a nixl sidecar?)")
        view = decode_metadata(payload, session_key, nonce)
        runtime = await NixlRuntime.get()
        runtime.wireup_window()  # the new endpoints wire up while both sides progress

        def load(lane: Lane) -> tuple[str, SlotTable]:
            name = lane.load_remote(view.metadata)
            try:
                return name, lane.prep_table(name, view.base, view.slot_stride, view.slot_bytes, view.num_slots)
            except BaseException:
                lane.unload_remote(name)
                raise

        got = await asyncio.gather(*(lane.call(load) for lane in runtime.lanes), return_exceptions=True)
        loaded = [(lane, g) for lane, g in zip(runtime.lanes, got) if isinstance(g, tuple)]
        if len(loaded) != len(got):
            for lane, (name, table) in loaded:
                lane.post(lambda lane, name=name, table=table: lane.unload_remote(name, table=table))
            error = next(g for g in got if isinstance(g, BaseException))
            raise TransportError(f"loading the peer's NIXL metadata failed: {error}") from error
        return runtime, _Remote(view, [g[0] for _, g in loaded], [g[1] for _, g in loaded])

    def _opened(self, extra: object) -> None:
        self._runtime, self._remote = extra  # type: ignore[misc]

    async def fetch(self, keys: Sequence[bytes], store: StoreLike, timeout: float, *,
                    count: asyncio.Future[int] | None = None, first: int = 1) -> int:
        """READ chunks from the holder's slots straight into ``store`` slots; leading keys now
        visible (``count``/``first``: see ``fetch.run_fetch``)."""
        self._check_open()
        assert self._remote is not None and self._runtime is not None
        if store.slot_bytes != self._remote.view.slot_bytes:
            raise TransportError(f"the peer's chunks are {self._remote.view.slot_bytes} bytes, "
                                 f"this store's slots {store.slot_bytes}")
        if store is not self._local_store:
            self._local_tables = await self._runtime.register_local(store)
            self._local_store = store
        self._fetching += 1
        try:
            return await run_fetch(keys, store, timeout, window=self._window,
                                   send_requests=self._request_chunks, fail=self._fail,
                                   metrics=self._metrics, count=count, first=first)
        except BaseException:
            # Reads already started finish first, so their slots are free when this raises.
            try:
                async with asyncio.timeout(READ_DRAIN_SECONDS):
                    await asyncio.shield(self._no_reads.wait())
            except TimeoutError:
                log.warning("NIXL: %d reads still running %gs after a failed fetch; their slots "
                            "stay reserved until they end", len(self._reading), READ_DRAIN_SECONDS)
            raise
        finally:
            self._fetching -= 1
            self._schedule_release()

    async def _request_chunks(self, batch: list[tuple[int, PendingChunk]]) -> None:
        self._check_open()
        rid = self._rids(len(batch))
        for j, (_, p) in enumerate(batch):
            p.reservation = _GuardedReservation(p.reservation)
            self._chunks[(rid + j) % proto.REQUEST_ID_MOD] = p
        await self._send([*self._take_releases(), *proto.encode_fetch(rid, [p.key for _, p in batch])])

    def _on_frame(self, header: proto.Header, payload: bytearray) -> bool:
        if header.type is not proto.MessageType.CHUNK_AT:
            return False
        key, checksum, slot = decode_chunk_at(payload)
        rid = header.request_id
        p = self._chunks.get(rid)
        if p is None or p.key != key:
            raise proto.ProtocolError("bad_key", f"CHUNK_AT {key.hex()} was not requested "
                                      f"under request id {rid}")
        assert self._remote is not None and self._runtime is not None
        view = self._remote.view
        if slot >= view.num_slots:
            raise proto.ProtocolError("malformed", f"CHUNK_AT slot {slot} outside the peer's "
                                      f"{view.num_slots} slots")
        del self._chunks[rid]
        self._start_read(rid, p, checksum, slot)
        return True

    def _start_read(self, rid: int, p: PendingChunk, checksum: int, remote_slot: int) -> None:
        assert self._remote is not None and self._runtime is not None
        res: _GuardedReservation = p.reservation  # type: ignore[assignment]
        lane = self._runtime.pick_lane()
        i = self._runtime.lanes.index(lane)
        name, far, local = self._remote.names[i], self._remote.tables[i], self._local_tables[i]
        verify, loop = self.verify, asyncio.get_running_loop()
        res.reading = True
        lane.queued += 1
        self._reading[rid] = p
        self._no_reads.clear()

        def job(lane: Lane) -> None:
            if p.done.done():  # the fetch already failed: do not touch the slot
                digest, error = None, TransportError("fetch ended before the read started")
            elif not p.gate.open():  # past the fetch's deadline, however late the loop is
                digest, error = None, LateWrite("the fetch reached its deadline before the read started")
                with contextlib.suppress(LateWrite):
                    p.gate.check()  # counted (late_writes)
            else:
                try:
                    digest, error = lane.read(name, local, res.slot, far, remote_slot, res.view, verify), None
                except LaneError as exc:
                    lane.unload_remote(name, now=True)  # its endpoint is unusable now
                    digest, error = None, exc
            self._finished.append((rid, p, lane, checksum, digest, error))
            with self._wake_lock:  # one loop wake-up per batch of finished reads
                wake, self._wake_pending = not self._wake_pending, True
            if wake:
                loop.call_soon_threadsafe(self._drain_finished)

        lane.post(job)

    def _drain_finished(self) -> None:
        with self._wake_lock:
            self._wake_pending = False
        while self._finished:
            self._read_done(*self._finished.popleft())

    def _read_done(self, rid: int, p: PendingChunk, lane: Lane, checksum: int,
                   digest: int | None, error: BaseException | None) -> None:
        lane.queued -= 1
        self._reading.pop(rid, None)
        if not self._reading:
            self._no_reads.set()
        res: _GuardedReservation = p.reservation  # type: ignore[assignment]
        if getattr(error, "slot_in_use", False):  # a READ that could not be cancelled: the slot
            log.error("NIXL: a READ into slot %d could not be cancelled; the slot stays reserved",
                      res.slot)              # stays reserved (never reused) rather than risk it
        else:
            res.read_finished()
        self._releases.append(rid)
        self._schedule_release()
        if p.done.done():
            return
        if error is not None:
            self._fail(error if isinstance(error, LateWrite) else TransportError(f"NIXL read failed: {error}"))
            return
        commit_received(p, checksum, self._metrics, checksum if digest is None else digest)

    def _take_releases(self) -> list:
        out: list = []
        while self._releases:
            batch, self._releases = self._releases[:4096], self._releases[4096:]
            out += encode_release(batch)
        return out

    def _schedule_release(self) -> None:
        """Send the pending RELEASEs once the callbacks of this loop pass have run (while a
        fetch runs they go with its next FETCH instead: one send less per chunk)."""
        if not self._release_scheduled and self._error is None and self._releases and not self._fetching:
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_releases)

    def _flush_releases(self) -> None:
        self._release_scheduled = False
        frames = self._take_releases()
        if not frames or self._error is not None:
            return
        if not self._send_lock.locked():  # nothing else being sent: straight to the socket
            try:
                frames = self._stream.send_now(frames)
            except OSError as exc:
                self._fail(TransportError(f"sending RELEASE failed: {exc}"))
                return
        if frames:
            task = asyncio.get_running_loop().create_task(self._send_releases(frames))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _send_releases(self, frames: list) -> None:
        try:
            await self._send(frames)
        except OSError as exc:
            self._fail(TransportError(f"sending RELEASE failed: {exc}"))

    def _fail(self, exc: BaseException) -> None:
        first = self._error is None
        super()._fail(exc)
        err = exc if isinstance(exc, TransportError) else TransportError(f"data connection failed: {exc}")
        for p in list(self._reading.values()):
            if not p.done.done():
                p.done.set_exception(err)
        if first and self._remote is not None and self._runtime is not None:
            for lane, name, table in zip(self._runtime.lanes, self._remote.names, self._remote.tables):
                lane.post(lambda lane, name=name, table=table: lane.unload_remote(name, table=table))
