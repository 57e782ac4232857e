"""The UCX data-plane server: answers authenticated peers' lookups and fetches from pinned slots.

Clients attach with their worker address and a MAC over their session, then
prove it with the nonce challenge. A FETCH is answered in batches of what the
send window admits: one message of CHUNK frames (key and checksum each), then
each chunk's bytes on its own tag straight from the pinned slot; send
completions release pins by callback. A connection that misses a deadline is
aborted before its pins are released.

Before the proof: attaches are read one at a time (at most ``ATTACH_BUFFER_BYTES``) and no
endpoint exists until the attach MAC verifies; then one session holds at most
``MAX_UNAUTHENTICATED_PER_SOURCE`` connections that have not answered their challenge
(``MAX_UNAUTHENTICATED_CONNECTIONS`` in all; more are refused as ``too_many_connections``),
each for at most ``auth_timeout``, its proof a message of at most
``UNAUTHENTICATED_BUFFER_BYTES``. Refusals are counted and logged through a ``RejectionLog``.
Proven connections follow ``serving.ProvenConnections`` (a bound per session, ended when
their session ends or after ``SILENT_CLOSE_SECONDS`` without a frame); UCX's own keepalive
is left as configured: the links' heartbeats cover UCX endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import Authorize, StoreLike, TransportError
from kv_offload_sidecar.data.before_auth import Place
from kv_offload_sidecar.data.serving import SessionServer, check_auth, describe, end_tasks, make_nonce, wait_until_idle
from kv_offload_sidecar.data.ucx.frames import (
    ATTACH_BUFFER_BYTES,
    ATTACH_TAG,
    CONTROL_BUFFER_BYTES,
    TAG_C2S,
    TAG_S2C,
    UNAUTHENTICATED_BUFFER_BYTES,
    attach_mac,
    data_tag,
    encode_address,
    join_parts,
    pack_frames,
    parse_frame,
    tag,
)
from kv_offload_sidecar.data.ucx.runtime import (
    UcxRuntime,
    register_server,
    unregister_server,
)

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics


log = logging.getLogger(__name__)

# Connections one server accepts at a time.
MAX_SERVER_CONNECTIONS = 1024

# Chunk sends one server connection keeps in flight.
SERVER_SENDS_IN_FLIGHT = 64

# Seconds without a request or send after which a stopping server closes a connection.
IDLE_CLOSE_SECONDS = 0.25

# Whom a refused attach is logged under before its MAC proved a session (UCX shows no address).
ATTACH_SOURCE = "ucx attach"


def session_source(session_id: bytes) -> str:
    """Whom a connection is counted and logged under once its attach MAC proved ``session_id``."""
    return "session " + session_id.hex()[:16]


class UcxDataPlaneServer(SessionServer):
    """Serves chunks from ``store`` over UCX tag messages (one per process)."""

    def __init__(self, store: StoreLike, authorize: Authorize, metrics: SidecarMetrics | None, *,
                 host: str = "127.0.0.1", port: int = 0, chunk_bytes: int, **session: Any) -> None:
        """``session``: ``SessionServer``'s bounds (timeouts, connections per session, rejections)."""
        del host, port  # UCX endpoints come from worker addresses, not a port
        # Strangers (``_limit``) are the connections attached but not yet through the nonce
        # challenge, per session and in all.
        super().__init__(store, authorize, metrics, chunk_bytes=chunk_bytes, logger=log, **session)
        self._conns: dict[int, asyncio.Task[None]] = {}
        self._connections: dict[int, _ServerConnection] = {}

    async def start(self) -> str:
        """Initialise UCX and return ``ucx://<base64 worker address>``."""
        rt = UcxRuntime.get()
        register_server(self)
        self.address = encode_address(rt.address)
        self._start_loops(self._accept_loop(rt), "ucx")
        return self.address

    def _end_proven(self, conn: _ServerConnection) -> None:
        task = self._conns.get(conn.cid)
        if task is not None:
            task.cancel()

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop accepting at once; keep serving open connections until each has been idle
        ``IDLE_CLOSE_SECONDS`` or ``grace_seconds`` pass, then abort them."""
        await self._stop_loops()
        await wait_until_idle(self._conns, self._connections, grace_seconds)
        await end_tasks(self._conns.values())
        unregister_server(self)

    async def _accept_loop(self, rt: UcxRuntime) -> None:
        while True:
            source = ATTACH_SOURCE
            try:
                buf = await rt.recv_frame(ATTACH_TAG, ATTACH_BUFFER_BYTES)
                header, payload = parse_frame(buf, None)
                if header.type is not proto.MessageType.UCX_ATTACH:
                    raise proto.ProtocolError("unauthenticated", f"{header.type.name} before UCX_ATTACH")
                attach = proto.decode_ucx_attach(payload)
                key = self._authorize(attach.session_id)
                mac = attach_mac(key, attach.connection_id, attach.worker_address) if key else b""
                if not key or not hmac.compare_digest(mac, attach.mac):
                    raise proto.ProtocolError("unauthenticated",
                                              "UCX_ATTACH with an unknown session or a wrong MAC")
                source = session_source(attach.session_id)
                if attach.connection_id in self._conns:
                    raise proto.ProtocolError("malformed", "UCX_ATTACH reuses a live connection id")
                if len(self._conns) >= MAX_SERVER_CONNECTIONS:
                    raise proto.ProtocolError("too_many_connections", "too many UCX data connections")
                place = self._limit.admit(source)  # replays of one attach hold few places
                if isinstance(place, str):
                    raise proto.ProtocolError("too_many_connections", place)
            except proto.ProtocolError as exc:
                self._refuse(source, exc.reason, exc.message)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken authorize callback or UCX error must not stop the server
                self._refuse(source, "unauthenticated", f"attach check failed: {describe(exc)}")
                await asyncio.sleep(0)
                continue
            cid = attach.connection_id
            task = asyncio.create_task(self._serve(rt, attach, place), name="ucx-data-conn")
            self._conns[cid] = task
            task.add_done_callback(lambda _t, cid=cid: self._conns.pop(cid, None))
            place.evict = lambda why, task=task, source=source: self._evict(task, source, why)

    async def _serve(self, rt: UcxRuntime, attach: proto.UcxAttach, place: Place) -> None:
        source = place.source
        try:
            try:
                ep = rt.endpoint(attach.worker_address)
            except Exception as exc:  # an unusable address: nothing to answer on
                self._refuse(source, "malformed", f"cannot reach an attaching client: {describe(exc)}")
                return
            conn = _ServerConnection(self, rt, ep, attach.connection_id, place)
            self._connections[attach.connection_id] = conn
            try:
                await conn.run()
            finally:
                self._connections.pop(attach.connection_id, None)
                conn.abort()
        finally:
            self._limit.leave(place, proved=False)  # nothing when it proved itself


class _ServerConnection:
    """One client of the UCX server: reads its frames, sends its chunks.

    A FETCH is answered in batches of as many chunks as the send window admits: the
    chunks are pinned, one message tells the client every chunk's checksum (the
    batch's CHUNK and CHUNK_MISSING frames back to back), then each chunk's bytes go
    out from its pinned slot. Completions are callbacks, not a task per chunk: a
    chunk's pin is released when its send is done, or after the endpoint was
    aborted (so a slot is never reused while UCX may still read it).
    """

    def __init__(self, server: UcxDataPlaneServer, rt: UcxRuntime, ep: Any, cid: int,
                 place: Place) -> None:
        self.server = server
        # Who the refusals of this connection are logged under (its session).
        self.source = place.source
        # Its place among the server's unauthenticated connections (given back at the proof).
        self.place = place
        self.rt = rt
        self.ep = ep
        self.cid = cid
        self.c2s = tag(cid, TAG_C2S)
        self.s2c = tag(cid, TAG_S2C)
        # Chunk sends in flight: token -> (its pin or None for a missing chunk, its batch).
        self.outstanding: dict[int, tuple[Any, _SendBatch]] = {}
        self._tokens = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self.window = asyncio.Semaphore(SERVER_SENDS_IN_FLIGHT)
        self.failed: BaseException | None = None
        self.aborted = False
        # Monotonic time of the last frame received or chunk sent.
        self.last = time.monotonic()
        # The session it proved (b"" before), and when it last received a frame (the sweep's).
        self.session_id = b""
        self.heard = self.last

    def idle(self, now: float) -> bool:
        return not self.outstanding and now - self.last >= IDLE_CLOSE_SECONDS

    async def run(self) -> None:
        srv, rt = self.server, self.rt
        try:
            nonce = make_nonce()
            async with asyncio.timeout(srv._auth_timeout):
                await rt.send(self.ep, join_parts(proto.encode_auth_challenge(nonce)), self.s2c)
                # A tiny frame limit until the proof (a longer message is refused as oversize).
                buf = await rt.recv_frame(self.c2s, UNAUTHENTICATED_BUFFER_BYTES)
                header, payload = parse_frame(buf, srv._chunk_bytes)
                if header.type is not proto.MessageType.AUTH_RESPONSE:
                    raise proto.ProtocolError("unauthenticated", f"{header.type.name} before AUTH_RESPONSE")
                answer = proto.decode_auth_response(payload)
                check_auth(srv._authorize, nonce, answer)
                self.session_id = answer.session_id
                srv._proven.admit(self)  # refused past connections_per_session
                await rt.send(self.ep, join_parts(proto.encode_auth_ok()), self.s2c)
            srv._limit.leave(self.place, proved=True)
            while self.failed is None:
                buf = await rt.recv_frame(self.c2s, CONTROL_BUFFER_BYTES)
                self.last = self.heard = time.monotonic()
                header, payload = parse_frame(buf, srv._chunk_bytes)
                mtype = header.type
                if mtype is proto.MessageType.LOOKUP:
                    hits = srv._store.lookup_prefix(proto.decode_keys(payload), touch=False)
                    await rt.send(self.ep, join_parts(proto.encode_lookup_reply(header.request_id, hits)),
                                  self.s2c)
                elif mtype is proto.MessageType.FETCH:
                    await self.send_chunks(header.request_id, proto.decode_keys(payload))
                elif mtype is proto.MessageType.CLOSE:
                    break
                else:
                    raise proto.ProtocolError("malformed", f"a client may not send {mtype.name}")
            await self.drained.wait()
        except proto.ProtocolError as exc:
            srv._refuse(self.source, exc.reason, exc.message)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await rt.send(self.ep, join_parts(proto.encode_error(0, exc.reason, exc.message)), self.s2c)
        except TimeoutError:
            srv._refuse(self.source, "timeout", f"no AUTH_RESPONSE within {srv._auth_timeout:.3g}s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("UCX data plane: connection ended: %s", describe(exc))
        finally:
            srv._proven.leave(self)
            if self.outstanding:
                self.fail(TransportError("connection ended with chunk sends in flight"))

    async def send_chunks(self, first_id: int, keys: list[bytes]) -> None:
        """Answer one FETCH in batches of what the send window admits."""
        i = 0
        while i < len(keys) and self.failed is None:
            await self.window.acquire()  # waits only when SERVER_SENDS_IN_FLIGHT are out
            batch = [(first_id + i, keys[i])]
            i += 1
            while i < len(keys) and not self.window.locked():
                await self.window.acquire()  # free: returns at once
                batch.append((first_id + i, keys[i]))
                i += 1
            if self.failed is not None:  # failed while waiting: nothing more goes out
                for _ in batch:
                    self.window.release()
                return
            self._post_batch(batch)

    def _post_batch(self, batch: list[tuple[int, bytes]]) -> None:
        """Pin the batch's chunks, send their CHUNK / CHUNK_MISSING frames as one message
        (or several when they exceed a control frame), then post each chunk's bytes. Each
        pin is in ``outstanding`` as soon as it is taken, so whatever fails later, fail()
        releases it."""
        srv, rt = self.server, self.rt
        tracker = _SendBatch(len(batch))
        tracker.timer = rt.loop.call_later(srv._send_timeout, self._deadline, tracker)
        self.drained.clear()
        frames: list[bytes] = []
        sends: list[tuple[int, int, Any]] = []  # (token, request id, pin or None)
        for request_id, key in batch:
            pin = srv._store.pin(key)
            self._tokens += 1
            self.outstanding[self._tokens] = (pin, tracker)
            sends.append((self._tokens, request_id, pin))
            if pin is None:  # the client posted a receive for the bytes: complete it with 1 byte
                frames.append(proto.join(proto.encode_chunk_missing(request_id, key)))
            else:
                prefix = proto.encode_chunk_prefix(key, pin.checksum)
                frames.append(proto.encode_header(proto.MessageType.CHUNK, request_id,
                                                  len(prefix) + srv._chunk_bytes) + prefix)
        for message in pack_frames(frames, CONTROL_BUFFER_BYTES):
            rt.post_send(self.ep, message, self.s2c).add_done_callback(self._control_sent)
        for token, request_id, pin in sends:
            data = pin.view if pin is not None else bytearray(1)
            rt.post_send(self.ep, data, data_tag(self.cid, request_id)).add_done_callback(
                functools.partial(self._chunk_sent, token))

    def _control_sent(self, fut: asyncio.Future[None]) -> None:
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self.fail(exc)

    def _chunk_sent(self, token: int, fut: asyncio.Future[None]) -> None:
        entry = self.outstanding.get(token)
        if entry is None:  # released when the connection failed
            return
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            log.info("UCX data plane: chunk send failed: %s", exc)
            self.fail(exc)  # aborts the endpoint, then releases every pin
            return
        pin, tracker = self.outstanding.pop(token)
        self.last = time.monotonic()
        if pin is not None:
            pin.release()
            if self.server._metrics is not None:
                self.server._metrics.peer_bytes.labels(direction="sent").inc(self.server._chunk_bytes)
        self.window.release()
        tracker.left -= 1
        if tracker.left == 0 and tracker.timer is not None:
            tracker.timer.cancel()
        if not self.outstanding:
            self.drained.set()

    def _deadline(self, tracker: _SendBatch) -> None:
        if tracker.left and self.failed is None:
            log.info("UCX data plane: %d chunk sends missed their %.3gs deadline",
                     tracker.left, self.server._send_timeout)
            self.fail(TimeoutError("chunk sends missed their deadline"))

    def fail(self, exc: BaseException) -> None:
        """End the connection: abort the endpoint (its sends are cancelled), then release
        every pin still out."""
        if self.failed is None:
            self.failed = exc
        self.abort()
        outstanding, self.outstanding = self.outstanding, {}
        for pin, tracker in outstanding.values():
            if pin is not None:
                pin.release()
            self.window.release()
            if tracker.timer is not None:
                tracker.timer.cancel()
        self.drained.set()

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.rt.abort(self.ep)


@dataclass
class _SendBatch:
    """The chunk sends of one batch of a FETCH, under one deadline."""

    # Sends not yet completed.
    left: int
    # Fires when the batch misses the server's send timeout.
    timer: asyncio.TimerHandle | None = None


