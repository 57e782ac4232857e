"""The local channel: a Unix socket per DP port for the engine client of the pod.

The framing, limits and key encoding are ``engine.channel_protocol`` (shared
with the engine's client). Chunk bytes never cross the socket: the engine
maps the store file (``/v1/local`` and ``info`` give its path and geometry)
and reads/writes the slots this channel hands out.

Ops:
- ``info {model_identity?, fingerprint?}`` -> ``{"instance", "store": {path, slot_bytes, slot_stride,
  num_slots}, "model_identity_refused", ...}``: the engine's tier states its model identity
  with every ``info`` (``peers.model_gate``: adopted by the first, compared after; a refusal
  says why, and the tier then uses nothing of the sidecar's)
- ``attach_region {offset, row_stride, num_rows, chunk_bytes}``, sent as the
  first frame of a connection with the descriptor of the file behind vLLM's
  primary region (SCM_RIGHTS) -> ``{region}``: the sidecar maps those rows and
  does the copies of ``store_rows`` / ``load_rows`` itself (vLLM's process
  moves no KV bytes). The region lives until that connection closes (after
  the jobs using it end). A descriptor on any other frame is closed unused.
- ``store_rows {region, keys, rows, deadline, paced?}`` -> ``{committed, cut}``: reserves
  slots (keys held already or without room are skipped), copies each reserved key's
  row into its slot, checksums and commits those copied by ``deadline``; ``cut``
  reserved keys did not land (the deadline or a cancel came first). ``"paced": true``
  (the engine has no other store waiting) spreads the copies
  (``engine_region.STORE_COPY_SHARE``) over the first half of the time to the
  deadline, so a store costs the engine's decoding less memory bandwidth; loads
  never wait behind a store's copies.
- ``load_rows {region, keys, rows, deadline}`` -> ``{loaded}``: makes the hit
  prefix local (fetching from peers until ``deadline``), copies the pinned
  chunks into their rows (no piece started after ``deadline``) and releases the
  pins; a chunk still on its way from a peer may land in its row instead
  (``peers.row_landings``: verified there, not stored); ``loaded`` leading keys
  are whole in vLLM's rows.
  ``deadline`` is a ``time.monotonic()`` value: CLOCK_MONOTONIC is one clock for
  every container of a pod. The engine gives up at the deadline (plus a grace
  for the piece in flight) and may then reuse the rows, so nothing is read from
  or written to them after it; with vLLM 0.34 it holds them until this answer
  comes, however late (``engine.channel_protocol``), so the answer is always sent.
- ``load``, ``load_rows`` and ``store_rows`` may carry ``"job"``, an id the engine
  chooses (a string of at most ``MAX_JOB_ID_CHARS``); ``cancel {jobs: [id]}`` ->
  ``{cancelled}`` (how many were running) makes those jobs stop at once: no
  fetch is awaited further, a copy stops before its next piece, and the job
  answers as at its deadline. Its answer is the engine's proof that no row is
  touched any more. A cancel that comes before its job (another connection)
  is remembered (the latest ``MAX_EARLY_CANCELS``) and the job answers at once.
- Every other request may carry ``"instance"``; a request naming another
  instance (the sidecar restarted and the engine still maps the old store
  file) is refused with ``"stale": true`` so nothing lands in the wrong file.
- ``lookup {keys: [hex], timeout}`` -> ``{local, peer, known_at}``: ``known_at`` is
  the ``time.monotonic()`` at which the sidecar knew the answer (its store read, and
  for peer hits the holder's count back; the chunks keep arriving while vLLM promotes
  them, and ``load_rows`` waits for them), so the engine can count its steps from there.
- ``reserve {keys}`` -> ``{id, slots: [int|null]}`` (null: already held, being
  written, or no free slot); then the engine writes the slots and sends
  ``commit {id, written: [bool]}`` -> ``{committed}`` (or ``abort {id}``).
- ``load {keys, timeout}`` -> ``{id, slots}`` for the hit prefix, made local
  (fetched from a peer when needed) and pinned until ``release {id}`` (no
  release is needed when ``slots`` is empty).

Reservations and pins belong to the connection: when it closes they are
aborted / released, so a crashed engine leaves nothing half-written or pinned.
A malformed frame gets an error reply and the connection is closed; every
parse failure is counted in ``kv_offload_protocol_errors_total`` and never
raises out of the server. A request whose handling fails unexpectedly gets an
error reply (one log line) and the connection serves the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.bulk_copies import copy_threads
from kv_offload_sidecar.control.channel_fields import (
    MAX_JOB_ID_CHARS,
    ChannelError,
    deadline_of,
    flag_of,
    id_of,
    job_of,
    keys_of,
    rows_of,
    timeout_of,
)
from kv_offload_sidecar.control.channel_jobs import ChannelJobs, unless_cancelled
from kv_offload_sidecar.control.fd_frames import FirstFrameError, first_frame
from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.rejections import clip
from kv_offload_sidecar.store.engine_region import EngineRegion, JobDeadline, RegionError, RowCopier
from kv_offload_sidecar.store.handles import PinnedChunk, WriteReservation

if TYPE_CHECKING:
    from kv_offload_sidecar.peers.row_landings import Landing
    from kv_offload_sidecar.sidecar import Sidecar

log = logging.getLogger(__name__)

class _Connection:
    """State of one engine connection: its reservations and pins."""

    def __init__(self, server: LocalChannelServer) -> None:
        self.sidecar = server.sidecar
        self.dp_index = server.dp_index
        self.server = server
        self.reservations: dict[int, list[WriteReservation | None]] = {}
        self.pins: dict[int, list[PinnedChunk]] = {}
        self._ids = itertools.count(1)
        # The region this connection attached (closed with the connection).
        self.region_id: int | None = None

    def close(self) -> None:
        if self.region_id is not None:
            self.server.detach_region(self.region_id)
            self.region_id = None
        for group in self.reservations.values():
            for res in group:
                if res is not None:
                    res.abort()
        for pins in self.pins.values():
            for p in pins:
                p.release()
        self.reservations.clear()
        self.pins.clear()

    async def handle(self, req: Any) -> dict[str, Any]:
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            raise ChannelError("request must be a JSON object with an 'op' string", fatal=True)
        op = req["op"]
        sidecar = self.sidecar
        if op == "info":
            return {"ok": True, **sidecar.local_info(self.dp_index, req.get("model_identity"),
                                                     req.get("fingerprint"))}
        instance = req.get("instance")
        if instance is not None and instance != sidecar.instance:
            raise ChannelError(f"request names sidecar instance {instance!r} but this is "
                               f"{sidecar.instance!r} (the sidecar restarted): re-attach the store",
                               stale=True)
        if op == "lookup":
            keys = keys_of(req)
            local, peer = await sidecar.lookup(keys, timeout_of(req, sidecar.settings.peers.fetch_deadline_seconds))
            return {"ok": True, "local": local, "peer": peer, "known_at": time.monotonic()}
        if op == "reserve":
            group = sidecar.reserve(keys_of(req))
            rid = next(self._ids)
            self.reservations[rid] = group
            return {"ok": True, "id": rid, "slots": [None if r is None else r.slot for r in group]}
        if op in ("commit", "abort"):
            group = self.reservations.pop(id_of(req), None)
            if group is None:
                raise ChannelError("unknown reservation id")
            written = req.get("written") if op == "commit" else None
            if written is not None and (not isinstance(written, list) or len(written) != len(group)):
                for r in group:
                    if r is not None:
                        r.abort()
                raise ChannelError("'written' must list one boolean per reserved key")
            committed = 0
            for i, res in enumerate(group):
                if res is None:
                    continue
                if op == "commit" and (written is None or written[i] is True):
                    committed += bool(res.commit(None))
                else:
                    res.abort()
            return {"ok": True, "committed": committed}
        if op == "load":
            keys = keys_of(req)
            timeout = timeout_of(req, sidecar.settings.peers.fetch_deadline_seconds)
            pins: list[PinnedChunk] = []
            try:
                with self.server.jobs.running(job_of(req), JobDeadline(time.monotonic() + timeout)) as stop:
                    if not stop.is_set():
                        await unless_cancelled(sidecar.load_each(keys, timeout, pins.append),
                                                stop)
            except BaseException:
                for p in pins:
                    p.release()
                raise
            pid = next(self._ids)
            if pins:
                self.pins[pid] = pins
            return {"ok": True, "id": pid, "slots": [p.slot for p in pins]}
        if op == "release":
            pins = self.pins.pop(id_of(req), None)
            if pins is None:
                raise ChannelError("unknown load id")
            for p in pins:
                p.release()
            return {"ok": True}
        if op == "cancel":
            jobs = req.get("jobs")
            if not isinstance(jobs, list) or len(jobs) > cp.MAX_KEYS or not all(
                    isinstance(j, str) and 0 < len(j) <= MAX_JOB_ID_CHARS for j in jobs):
                raise ChannelError(f"'jobs' must list job ids (strings of 1..{MAX_JOB_ID_CHARS} "
                                   f"characters)")
            return {"ok": True, "cancelled": self.server.jobs.cancel(jobs)}
        if op == "store_rows":
            return await self._store_rows(req)
        if op == "load_rows":
            return await self._load_rows(req)
        if op == "attach_region":
            raise ChannelError("attach_region must be the first frame of a connection and carry "
                               "the region's file descriptor", fatal=True)
        raise ChannelError(f"unknown op {op!r}; ops are {', '.join(cp.OPS)}", reason="unknown_type")

    def attach_region(self, req: Any, fd: int) -> dict[str, Any]:
        """Map the rows of the region behind ``fd`` (the first frame of this connection)."""
        try:
            region = EngineRegion(fd, offset=req.get("offset"), row_stride=req.get("row_stride"),
                                  num_rows=req.get("num_rows"), chunk_bytes=req.get("chunk_bytes"))
        except RegionError as exc:
            raise ChannelError(str(exc), fatal=True, reason="bad_size") from None
        slot_bytes = self.sidecar.settings.pool.kv_bytes_per_chunk  # the store's slot size
        if region.chunk_bytes > slot_bytes:
            region.close()
            raise ChannelError(f"region chunks of {region.chunk_bytes} bytes do not fit this "
                               f"sidecar's {slot_bytes}-byte slots", fatal=True, reason="bad_size")
        self.region_id = self.server.register_region(region)
        # Faulted in beside the first jobs' copies, not ahead of them.
        self.server.copier.prefault(region)
        return {"ok": True, "region": self.region_id}

    def _region(self, req: dict[str, Any]) -> EngineRegion:
        rid = req.get("region")
        region = self.server.regions.get(rid) if isinstance(rid, int) else None
        if region is None or not region.acquire():
            raise ChannelError(f"unknown region {rid!r}: attach the region again", stale=True)
        return region

    async def _store_rows(self, req: dict[str, Any]) -> dict[str, Any]:
        keys = keys_of(req)
        deadline = JobDeadline(deadline_of(req))
        job = job_of(req)
        paced = flag_of(req, "paced")
        region = self._region(req)
        server, metrics = self.server, self.sidecar.metrics.engine_transfer
        group: list[WriteReservation | None] = []
        copies: list[asyncio.Future[int | None]] = []
        try:
            rows = rows_of(region, req, len(keys))
            group = self.sidecar.reserve(keys)
            todo = [(rows[i], r) for i, r in enumerate(group) if r is not None]
            started = time.perf_counter()
            with server.jobs.running(job, deadline):
                copies = [asyncio.wrap_future(server.copier.store(region, row, r.view, deadline,
                                                                  paced))
                          for row, r in todo]
                sums = await asyncio.gather(*copies)
            metrics.labels(op="store", phase="copy").observe(time.perf_counter() - started)
            committed = sum(bool(r.commit(computed_checksum=c)) for (_, r), c in zip(todo, sums)
                            if c is not None)
            return {"ok": True, "committed": committed, "cut": len(todo) - committed}
        finally:
            if copies:  # no slot goes back while its copy may still run
                await asyncio.gather(*copies, return_exceptions=True)
            for r in group:
                if r is not None:
                    r.abort()  # no-op once committed
            region.release()

    async def _load_rows(self, req: dict[str, Any]) -> dict[str, Any]:
        """Each chunk is copied into its row as soon as it is here (held, or landed from a
        peer), on the copy thread, while the next ones are still on the wire; a chunk still
        to come from a peer may land in its row straight away (``peers.row_landings``)."""
        keys = keys_of(req)
        deadline = JobDeadline(deadline_of(req))
        job = job_of(req)
        region = self._region(req)
        server, metrics = self.server, self.sidecar.metrics.engine_transfer
        pins: list[PinnedChunk] = []
        copies: list[asyncio.Future[bool]] = []
        offers: list[Landing | None] = []
        try:
            rows = rows_of(region, req, len(keys))
            offers = self._offer_rows(region, keys, rows, deadline.at)

            def take(pin: PinnedChunk | None) -> None:
                row = rows[len(copies)]
                if pin is None:  # it landed in its row, verified
                    landed = asyncio.get_running_loop().create_future()
                    landed.set_result(True)
                    copies.append(landed)
                    return
                copies.append(asyncio.wrap_future(server.copier.load(region, pin.view, row, deadline)))
                pins.append(pin)

            with server.jobs.running(job, deadline) as stop:
                started = time.perf_counter()
                remaining = deadline.at - time.monotonic()
                if remaining > 0 and not stop.is_set():
                    await unless_cancelled(self.sidecar.load_each(keys, remaining, take, offers), stop)
                fetched = time.perf_counter()
                metrics.labels(op="load", phase="fetch").observe(fetched - started)
                whole = await asyncio.gather(*copies)
            # The copy time the fetch did not hide.
            metrics.labels(op="load", phase="copy").observe(time.perf_counter() - fetched)
            loaded = next((i for i, ok in enumerate(whole) if not ok), len(whole))
            return {"ok": True, "loaded": loaded}
        finally:
            self.sidecar.landings.release(offers)  # no transport writes a row past this
            if copies:  # no pin goes back while its copy may still run
                await asyncio.gather(*copies, return_exceptions=True)
            for p in pins:
                p.release()
            region.release()

    def _offer_rows(self, region: EngineRegion, keys: list[bytes], rows: list[int],
                    deadline: float) -> list[Landing | None]:
        """Offer the rows of the keys the store lacks to the fetches bringing them (None per key
        not offered) until the job's ``deadline`` (``row_landings``: no write into a row starts
        after it, even while the loop is late): only when fetched chunks are dropped after the
        load anyway (``--peer-copies drop``) and a row holds exactly a slot's bytes."""
        sidecar, store = self.sidecar, self.sidecar.store
        if sidecar.settings.store.peer_copies != "drop" or store is None or region.chunk_bytes != store.slot_bytes:
            return []
        return [None if store.contains(key) else sidecar.landings.offer(key, memoryview(region.row(row)), deadline)
                for key, row in zip(keys, rows)]


class LocalChannelServer:
    """Serves the local channel of one DP port on ``sidecar.local_socket_path``."""

    def __init__(self, sidecar: Sidecar, dp_index: int) -> None:
        self.sidecar = sidecar
        self.dp_index = dp_index
        self.path = sidecar.local_socket_path(dp_index)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        # Engine regions attached over this channel, by id.
        self.regions: dict[int, EngineRegion] = {}
        self._region_ids = itertools.count(1)
        # The thread that copies between vLLM's rows and the store's slots.
        self.copier = RowCopier(copy_threads())
        # Jobs running with an id, and cancels that came before their job.
        self.jobs = ChannelJobs()
        # Frames being answered (read, reply not yet written) and set when there are none:
        # stop() lets each reply out before it drops the connections.
        self._answering = 0
        self._all_answered = asyncio.Event()
        self._all_answered.set()

    async def start(self) -> None:
        if len(self.path.encode()) > 100:
            raise ValueError(f"local channel socket path {self.path!r} is too long for a Unix socket; "
                             f"use a shorter --shm-dir or --identity")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_loop(listener))

    async def stop(self, grace: float) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, drop connections."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        end = asyncio.get_running_loop().time() + grace
        await self.sidecar.wait_idle(grace)
        with contextlib.suppress(TimeoutError):  # the sidecar's work done, its replies go out
            async with asyncio.timeout_at(end):
                await self._all_answered.wait()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        for region in list(self.regions.values()):
            region.close()
        self.regions.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.copier.close)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def register_region(self, region: EngineRegion) -> int:
        rid = next(self._region_ids)
        self.regions[rid] = region
        return rid

    def detach_region(self, rid: int) -> None:
        region = self.regions.pop(rid, None)
        if region is not None:
            region.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of descriptors: keep serving the open connections
                log.warning("local channel %s: accept failed: %s", self.path, exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(sock))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket) -> None:
        conn = _Connection(self)
        metrics = self.sidecar.metrics
        writer: asyncio.StreamWriter | None = None
        try:
            first = await first_frame(sock)
            if first is None:
                sock.close()
                return
            body, fds, extra = first
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            if extra:  # the engine waits for each answer: nothing may follow the first frame yet
                metrics.protocol_errors.labels(reason="malformed").inc()
                for fd in fds:
                    os.close(fd)
                return
            if not await self._answer(conn, writer, body, fds):
                return
            while True:
                try:
                    head = await reader.readexactly(cp.LENGTH.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    n = cp.frame_length(head)
                except ValueError as exc:
                    metrics.protocol_errors.labels(reason="oversize").inc()
                    await _send(writer, {"ok": False, "error": str(exc)})
                    return
                try:
                    body = await reader.readexactly(n)
                except (asyncio.IncompleteReadError, ConnectionError):
                    metrics.protocol_errors.labels(reason="malformed").inc()
                    return
                if not await self._answer(conn, writer, body, []):
                    return
        except FirstFrameError as exc:
            metrics.protocol_errors.labels(reason=exc.reason).inc()
            with contextlib.suppress(OSError):
                sock.sendall(cp.encode_frame({"ok": False, "error": str(exc)}))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            conn.close()
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()
            else:
                sock.close()

    async def _answer(self, conn: _Connection, writer: asyncio.StreamWriter, body: bytes,
                      fds: list[int]) -> bool:
        """Answer one frame; False when the connection must close."""
        metrics = self.sidecar.metrics
        self._answering += 1
        self._all_answered.clear()
        try:
            try:
                req = cp.decode_body(body)
            except ValueError as exc:
                metrics.protocol_errors.labels(reason="malformed").inc()
                await _send(writer, {"ok": False, "error": str(exc)})
                return False
            try:
                if fds and isinstance(req, dict) and req.get("op") == "attach_region":
                    reply = conn.attach_region(req, fds[0])
                else:
                    reply = await conn.handle(req)
            except ChannelError as exc:
                if not exc.stale:
                    metrics.protocol_errors.labels(reason=exc.reason).inc()
                await _send(writer, {"ok": False, "error": str(exc), "stale": exc.stale})
                return not exc.fatal
            except RuntimeError as exc:  # the sidecar is stopping
                await _send(writer, {"ok": False, "error": str(exc)})
                return False
            except Exception as exc:  # a bug or a peer's bad answer: this request fails, not the channel
                op = clip(str(req.get("op")) if isinstance(req, dict) else "?", 32)
                log.warning("local channel %s: %s failed: %s: %s", self.path, op, type(exc).__name__, clip(str(exc)))
                await _send(writer, {"ok": False, "error": f"{op} failed: {type(exc).__name__}"})
                return True
            await _send(writer, reply)
            return True
        finally:
            self._answering -= 1
            if not self._answering:
                self._all_answered.set()
            for fd in fds:  # a mapping keeps its own reference to the file
                with contextlib.suppress(OSError):
                    os.close(fd)


async def _send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(cp.encode_frame(obj))
    await writer.drain()
