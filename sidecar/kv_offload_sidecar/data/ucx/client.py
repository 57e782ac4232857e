"""The UCX data-plane client: lookups and fetches to one peer, chunks received into store slots.

The client posts each chunk's receive on its reserved slot *before* it sends
the FETCH, so the bytes never wait in UCX's unexpected queue, keeps
``UCX_WINDOW`` chunks in flight, and verifies each checksum before the chunk
becomes visible (a chunk of ``OFF_LOOP_BYTES`` or more on one of the process's checksum
threads, ``data.checksum_threads``, so the loop keeps progressing UCX meanwhile). With two lanes every
``GET_LANE_EVERY``-th chunk goes over a
second connection whose copies the fetcher's core makes; a failure of either
fails both.

A slot is handed back only once no byte can land in it. A receive UCX has matched may still
complete after this side gave up: with ``put_zcopy`` over shared memory the holder writes
into the slot itself (a CMA write), whenever it runs again, and closing the endpoint does not
stop it. So a failed connection does not close its endpoint while receives into slots are
still posted: it keeps progressing them (``_drain``) and frees each slot when its receive
completes (the holder's writes are over; the bytes are dropped), then closes. Receives still
posted after ``DRAIN_SECONDS`` (a holder stopped or dead) leave their slots quarantined: never
reused by this process (``quarantined_slots``), rather than risk a later chunk, committed with
its checksum, being overwritten.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import TransportError, auth_proof, count_protocol_error
from kv_offload_sidecar.data.checksum_threads import checksum_off_loop, hashes_off_loop
from kv_offload_sidecar.data.fetch import PendingChunk, answer_lookup, commit_received
from kv_offload_sidecar.data.peer_client import (
    FramedPeerDataClient,
    challenge_nonce,
    check_auth_ok,
    raise_if_refused,
)
from kv_offload_sidecar.data.ucx.frames import (
    ATTACH_TAG,
    CHUNK_REPLIES,
    CONTROL_BUFFER_BYTES,
    UNAUTHENTICATED_BUFFER_BYTES,
    TAG_C2S,
    TAG_S2C,
    UCX_REQUEST_ID_MOD,
    attach_mac,
    data_tag,
    decode_address,
    join_parts,
    parse_frame,
    split_frames,
    tag,
)
from kv_offload_sidecar.data.ucx.runtime import UcxRuntime, configured_lanes

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics


log = logging.getLogger(__name__)

# Chunks a UCX client keeps in flight per fetch by default (UCX moves a chunk while the
# fetcher verifies the previous ones; deeper than TCP's window because every chunk waits
# for a rendezvous round trip between the two processes).
UCX_WINDOW = 32

# Seconds a failed connection keeps progressing the receives still posted into slots before it
# closes its endpoint; a slot whose receive did not complete by then is never reused.
DRAIN_SECONDS = 30.0

# With two lanes, every GET_LANE_EVERY-th chunk of a fetch takes the fetcher-copied lane: the
# fetcher's core also verifies every chunk, so it takes the smaller share of the copying.
GET_LANE_EVERY = 3


class UcxPeerDataClient(FramedPeerDataClient):
    """An authenticated UCX connection to one peer's data plane.

    With two lanes it has a partner: a second authenticated connection from this
    process's ``get_zcopy`` worker (``UcxRuntime.get_lane``). A fetch sends every
    ``GET_LANE_EVERY``-th chunk over the partner (the fetcher copies those) and the
    rest over this connection (the holder copies those), so both cores copy at once.
    Lookups use this connection; a failure of either connection fails both.
    """

    def __init__(self, rt: UcxRuntime, ep: Any, cid: int, metrics: SidecarMetrics | None,
                 window: int) -> None:
        super().__init__(metrics, window)
        self._rt = rt
        self._ep = ep
        self._cid = cid
        self._c2s = tag(cid, TAG_C2S)
        self._s2c = tag(cid, TAG_S2C)
        self._chunks: dict[int, _UcxChunk] = {}
        self._partner: UcxPeerDataClient | None = None
        self._turn = 0  # chunks requested so far, modulo GET_LANE_EVERY
        self._requested = 0  # chunks requested over this connection
        self._replies = [0, 0]  # messages carrying chunk replies, CHUNK/CHUNK_MISSING frames in them

    @property
    def lanes(self) -> int:
        """Connections to the peer: this one, and its partner when it has one."""
        return len(self.connections)

    @property
    def connections(self) -> list[UcxPeerDataClient]:
        """Every connection to the peer, each of which gets the links' heartbeat
        (``peers.liveness.lanes_of``): a holder closes a connection that received nothing for
        ``serving.SILENT_CLOSE_SECONDS``, the partner included."""
        return [self] if self._partner is None else [self, self._partner]

    @classmethod
    async def connect(cls, address: str, session_id: bytes, session_key: bytes, *,
                      timeout: float, metrics: SidecarMetrics | None = None,
                      window: int = UCX_WINDOW, lanes: int | None = None) -> UcxPeerDataClient:
        """Attach to the server at ``ucx://...`` and authenticate; TransportError on failure.

        ``lanes``: 1 or 2 (see ``configure_ucx_env``); default: the configured count.
        """
        lanes = configured_lanes() if lanes is None else lanes
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
                await rt.send(ep, join_parts(proto.encode_ucx_attach(cid, session_id, mac, rt.address)),
                              ATTACH_TAG)
                s2c, c2s = tag(cid, TAG_S2C), tag(cid, TAG_C2S)
                buf = await rt.recv_frame(s2c, UNAUTHENTICATED_BUFFER_BYTES)
                nonce = challenge_nonce(*parse_frame(buf, None))
                await rt.send(ep, join_parts(proto.encode_auth_response(session_id, auth_proof(session_key, nonce))),
                              c2s)
                check_auth_ok(*parse_frame(await rt.recv_frame(s2c, UNAUTHENTICATED_BUFFER_BYTES), None))
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
        await self._rt.send(self._ep, join_parts(frame), self._c2s)

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
            p.reservation = _DrainedReservation(p.reservation)
            data = self._rt.post_recv(self._ep, p.reservation.view, data_tag(self._cid, rid + j))
            p.reservation.posted(data)
            self._chunks[rid + j] = _UcxChunk(p, data)
            data.add_done_callback(lambda _f, r=rid + j: self._data_arrived(r))
        await self._send(proto.encode_fetch(rid, [p.key for _, p in batch]))

    def _data_arrived(self, request_id: int) -> None:
        self.heard_at = time.monotonic()
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
        elif hashes_off_loop(st.p.nbytes):
            self._verify_off_loop(st.p, st.checksum)
        else:
            commit_received(st.p, st.checksum, self._metrics)

    def _verify_off_loop(self, p: PendingChunk, checksum: int) -> None:
        """Hash the slot on a checksum thread, then commit it on the loop (the fetch may have
        given up meanwhile: its abort makes the commit a no-op)."""
        try:
            digest = checksum_off_loop(p.reservation.view)
        except RuntimeError:  # the interpreter is shutting down: no new threads; hash here
            commit_received(p, checksum, self._metrics)
            return

        def verified(f: asyncio.Future[int]) -> None:
            if f.cancelled() or f.exception() is not None:  # the view was released meanwhile
                commit_received(p, checksum, self._metrics)
            else:
                commit_received(p, checksum, self._metrics, f.result())

        digest.add_done_callback(verified)

    def _in_flight(self) -> Iterator[PendingChunk]:
        return (st.p for st in self._chunks.values())

    async def close(self) -> None:
        """Send CLOSE (best effort) and close the endpoint (and the partner's)."""
        if self._error is not None:
            return
        partner = self._partner
        if partner is not None:
            self._partner = partner._partner = None
            await partner.close()
        await super().close()

    def _connection_failed(self, err: TransportError) -> None:
        """Close the endpoint once no receive into a slot is posted any more (``_drain``: a
        matched one may still be written by the holder) and fail the partner connection too."""
        posted = [st.data for st in self._chunks.values() if not st.data.done()]
        if posted:
            task = asyncio.get_running_loop().create_task(self._drain(posted), name="ucx-drain")
            _draining.add(task)
            task.add_done_callback(_draining.discard)
        else:
            self._rt.abort(self._ep)
            _release_connection_id(self._cid)
        if self._partner is not None:
            self._partner._fail(err)

    async def _drain(self, posted: list[asyncio.Future[None]]) -> None:
        """Progress the receives still posted into slots until they complete (each frees its
        slot then, ``_DrainedReservation``) or ``DRAIN_SECONDS`` pass, then close the endpoint."""
        try:
            await asyncio.wait(posted, timeout=DRAIN_SECONDS)
        finally:
            left = sum(1 for f in posted if not f.done())
            if left:
                _quarantine["slots"] += left
                log.error("UCX: %d receives into store slots were still posted %.0f s after their "
                          "connection failed (a holder stopped or gone); their slots are never "
                          "reused by this process", left, DRAIN_SECONDS)
            self._rt.abort(self._ep)
            _release_connection_id(self._cid)

    async def _read_loop(self) -> None:
        try:
            while True:
                buf = await self._rt.recv_frame(self._s2c, CONTROL_BUFFER_BYTES)
                self.heard_at = time.monotonic()
                frames = split_frames(buf)
                for header, payload in frames:
                    self._on_frame(header, payload)
                if frames and frames[0][0].type in CHUNK_REPLIES:
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
            raise_if_refused(header, payload)
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


class _DrainedReservation:
    """A reservation whose slot a posted UCX receive may still write into: ``abort`` frees the
    slot only once that receive completed without error (the holder's writes are over); one
    that failed or was cancelled with the endpoint leaves the slot quarantined."""

    def __init__(self, reservation: Any) -> None:
        self._res = reservation
        self.key = reservation.key
        self.view = reservation.view
        self._data: asyncio.Future[None] | None = None
        self._abort_wanted = False

    @property
    def refused(self) -> str | None:
        return getattr(self._res, "refused", None)

    def posted(self, data: asyncio.Future[None]) -> None:
        self._data = data
        data.add_done_callback(self._received)

    def receive_view(self, stop: Any, gate: Any = None) -> memoryview:
        return self.view

    def commit(self, expected_checksum: int | None = None, *, computed_checksum: int | None = None) -> bool:
        return self._res.commit(expected_checksum, computed_checksum=computed_checksum)

    def abort(self) -> None:
        data = self._data
        if data is None or (data.done() and not data.cancelled() and data.exception() is None):
            self._res.abort()
        elif not self._abort_wanted:
            self._abort_wanted = True  # freed by _received, if ever
            _held.add(self)

    def _received(self, data: asyncio.Future[None]) -> None:
        if self._abort_wanted and not data.cancelled() and data.exception() is None:
            _held.discard(self)
            self._res.abort()


# Tasks draining failed connections (kept referenced until they end).
_draining: set[asyncio.Task[None]] = set()
# Slots left quarantined by connections whose receives never completed.
_quarantine = {"slots": 0}


# Reservations aborted while their receive was still posted, not freed yet.
_held: set[_DrainedReservation] = set()


def slots_held_after_failure() -> int:
    """Store slots failed connections keep reserved now: their receive was still posted when
    their fetch gave up (freed when it completes; never, once quarantined)."""
    return len(_held)


def quarantined_slots() -> int:
    """Store slots this process never reuses: a failed UCX connection's receive into them was
    still posted ``DRAIN_SECONDS`` after the failure."""
    return _quarantine["slots"]


# Connection ids in use by this process's clients (a tag's high half).
_client_cids: set[int] = set()


def _new_connection_id() -> int:
    while True:
        cid = secrets.randbits(32)
        if cid and cid not in _client_cids:
            _client_cids.add(cid)
            return cid


def _release_connection_id(cid: int) -> None:
    _client_cids.discard(cid)


