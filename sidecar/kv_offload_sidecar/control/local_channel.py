"""The local channel: a Unix socket per DP port for the engine client of the pod.

The framing, limits and key encoding are ``engine.channel_protocol`` (shared
with the engine's client). Chunk bytes never cross the socket: the engine
maps the store file (``/v1/local`` and ``info`` give its path and geometry)
and reads/writes the slots this channel hands out.

Ops:
- ``info`` -> ``{"instance", "store": {path, slot_bytes, slot_stride, num_slots}, ...}``
- Every other request may carry ``"instance"``; a request naming another
  instance (the sidecar restarted and the engine still maps the old store
  file) is refused with ``"stale": true`` so nothing lands in the wrong file.
- ``lookup {keys: [hex], timeout}`` -> ``{local, peer}``
- ``reserve {keys}`` -> ``{id, slots: [int|null]}`` (null: already held, being
  written, or no free slot); then the engine writes the slots and sends
  ``commit {id, written: [bool]}`` -> ``{committed}`` (or ``abort {id}``).
- ``load {keys, timeout}`` -> ``{id, slots}`` for the hit prefix, made local
  (fetched from a peer when needed) and pinned until ``release {id}`` (no
  release is needed when ``slots`` is empty).

Reservations and pins belong to the connection: when it closes they are
aborted / released, so a crashed engine leaves nothing half-written or pinned.
A malformed frame gets an error reply and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.store.handles import PinnedChunk, WriteReservation

if TYPE_CHECKING:
    from kv_offload_sidecar.sidecar import Sidecar

log = logging.getLogger(__name__)



class ChannelError(Exception):
    """A bad request: answered with its message; ``fatal`` closes the connection."""

    def __init__(self, message: str, *, fatal: bool = False, reason: str = "malformed",
                 stale: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal
        self.reason = reason
        # True when the request names another sidecar instance (the engine must re-attach).
        self.stale = stale


def _keys(req: dict[str, Any]) -> list[bytes]:
    try:
        return cp.decode_keys(req.get("keys"))
    except OverflowError as exc:
        raise ChannelError(str(exc), reason="oversize") from None
    except KeyError as exc:
        raise ChannelError(exc.args[0], reason="bad_key") from None
    except ValueError as exc:
        raise ChannelError(str(exc)) from None


def _timeout(req: dict[str, Any], default: float) -> float:
    t = req.get("timeout", default)
    limit = cp.MAX_TIMEOUT_SECONDS
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= limit:
        raise ChannelError(f"'timeout' must be seconds in (0, {limit}], got {t!r}")
    return float(t)


def _id(req: dict[str, Any]) -> int:
    v = req.get("id")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ChannelError("'id' must be the integer returned by reserve/load")
    return v


class _Connection:
    """State of one engine connection: its reservations and pins."""

    def __init__(self, sidecar: Sidecar, dp_index: int) -> None:
        self.sidecar = sidecar
        self.dp_index = dp_index
        self.reservations: dict[int, list[WriteReservation | None]] = {}
        self.pins: dict[int, list[PinnedChunk]] = {}
        self._ids = itertools.count(1)

    def close(self) -> None:
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
            return {"ok": True, **sidecar.local_info(self.dp_index)}
        instance = req.get("instance")
        if instance is not None and instance != sidecar.instance:
            raise ChannelError(f"request names sidecar instance {instance!r} but this is "
                               f"{sidecar.instance!r} (the sidecar restarted): re-attach the store",
                               stale=True)
        if op == "lookup":
            keys = _keys(req)
            local, peer = await sidecar.lookup(keys, _timeout(req, sidecar.settings.fetch_deadline_seconds))
            return {"ok": True, "local": local, "peer": peer}
        if op == "reserve":
            group = sidecar.reserve(_keys(req))
            rid = next(self._ids)
            self.reservations[rid] = group
            return {"ok": True, "id": rid, "slots": [None if r is None else r.slot for r in group]}
        if op in ("commit", "abort"):
            group = self.reservations.pop(_id(req), None)
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
            keys = _keys(req)
            pins = await sidecar.load(keys, _timeout(req, sidecar.settings.fetch_deadline_seconds))
            pid = next(self._ids)
            if pins:
                self.pins[pid] = pins
            return {"ok": True, "id": pid, "slots": [p.slot for p in pins]}
        if op == "release":
            pins = self.pins.pop(_id(req), None)
            if pins is None:
                raise ChannelError("unknown load id")
            for p in pins:
                p.release()
            return {"ok": True}
        raise ChannelError(f"unknown op {op!r}; ops are {', '.join(cp.OPS)}", reason="unknown_type")


class LocalChannelServer:
    """Serves the local channel of one DP port on ``sidecar.local_socket_path``."""

    def __init__(self, sidecar: Sidecar, dp_index: int) -> None:
        self.sidecar = sidecar
        self.dp_index = dp_index
        self.path = sidecar.local_socket_path(dp_index)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        if len(self.path.encode()) > 100:
            raise ValueError(f"local channel socket path {self.path!r} is too long for a Unix socket; "
                             f"use a shorter --shm-dir or --identity")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def stop(self, grace: float) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, drop connections."""
        if self._server is not None:
            self._server.close()
            self._server = None
        await self.sidecar.wait_idle(grace)
        for t in list(self._conns):
            t.cancel()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        conn = _Connection(self.sidecar, self.dp_index)
        metrics = self.sidecar.metrics
        try:
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
                try:
                    req = cp.decode_body(body)
                except ValueError as exc:
                    metrics.protocol_errors.labels(reason="malformed").inc()
                    await _send(writer, {"ok": False, "error": str(exc)})
                    return
                try:
                    reply = await conn.handle(req)
                except ChannelError as exc:
                    if not exc.stale:
                        metrics.protocol_errors.labels(reason=exc.reason).inc()
                    await _send(writer, {"ok": False, "error": str(exc), "stale": exc.stale})
                    if exc.fatal:
                        return
                    continue
                except RuntimeError as exc:  # the sidecar is stopping
                    await _send(writer, {"ok": False, "error": str(exc)})
                    return
                await _send(writer, reply)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            conn.close()
            if task is not None:
                self._conns.discard(task)
            with contextlib.suppress(Exception):
                writer.close()


async def _send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(cp.encode_frame(obj))
    await writer.drain()
