"""What the engine client holds of one sidecar: local-channel connections and the attachment.

``LocalConn`` is one blocking connection of the local channel (frames of
``channel_protocol``; a frame may carry one descriptor). ``Attachment`` is
what the client holds of one sidecar instance: its mapped store file and, when
the engine offered its primary rows (``RowRegion``), the region handed over on
a connection kept open for the attachment's life (the sidecar unmaps it when
that connection closes). Standard library only.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.engine.region_file import RegionFile
from kv_offload_sidecar.engine.store_view import ChunkStoreView


class Late(Exception):
    """The sidecar did not answer in time."""


@dataclass(frozen=True)
class RowRegion:
    """vLLM's primary rows as the sidecar is to map them."""

    # The file behind the rows (found once by ``region_file.find_region_file``).
    file: RegionFile
    # Bytes between row starts.
    row_stride: int
    # Rows in the region.
    num_rows: int
    # Chunk bytes at the start of each row.
    chunk_bytes: int


class LocalConn:
    """One local-channel connection (used by one thread at a time)."""

    def __init__(self, path: str, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise

    def send(self, req: Mapping[str, Any], timeout: float) -> None:
        """Send ``req`` only (its answer is read by the caller, e.g. a ``PendingLookup``)."""
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(cp.encode_frame(req))
        except socket.timeout:
            raise Late() from None

    def call(self, req: Mapping[str, Any], timeout: float, fd: int | None = None) -> dict[str, Any]:
        """Send ``req`` (with descriptor ``fd`` attached, SCM_RIGHTS) and read the reply."""
        self.sock.settimeout(timeout)
        try:
            frame = cp.encode_frame(req)
            if fd is None:
                self.sock.sendall(frame)
            else:
                sent = socket.send_fds(self.sock, [frame], [fd])
                self.sock.sendall(frame[sent:])
            try:
                n = cp.frame_length(self._recv_exact(cp.LENGTH.size))
            except ValueError as exc:
                raise ConnectionError(f"sidecar reply: {exc}") from None
            reply = cp.decode_body(self._recv_exact(n))
        except socket.timeout:
            raise Late() from None
        if not isinstance(reply, dict):
            raise ConnectionError("sidecar reply is not a JSON object")
        return reply

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("sidecar closed the local channel")
            got += k
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Attachment:
    """The mapped store of one sidecar instance, and the engine region handed to it."""

    def __init__(self, info: Mapping[str, Any], socket_path: str, region: RowRegion | None,
                 timeout: float) -> None:
        st = info["store"]
        self.instance = str(info["instance"])
        self.view = ChunkStoreView.attach(str(st["path"]), int(st["slot_bytes"]), int(st["num_slots"]),
                                          int(st["slot_stride"]))
        # The sidecar's id of the engine region (None: the engine copies itself).
        self.region_id: int | None = None
        # Why the region is not attached ("" when it is).
        self.region_reason = "no region was offered"
        # Set when the sidecar no longer knows the region (attach again).
        self.region_lost = False
        self._region_conn: LocalConn | None = None
        if region is not None:
            self._attach_region(socket_path, region, timeout)

    def each_slot(self, slots: Sequence[int | None],
                  fn: Callable[[int, memoryview], None]) -> BaseException | None:
        """``fn(i, view of slots[i])`` for each slot (None: skipped) until one raises; returns
        that error of the engine's own (the caller gives the slots back, then raises it)."""
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            view = self.view.slot_view(slot)
            try:
                fn(i, view)
            except BaseException as exc:
                return exc
            finally:
                try:
                    view.release()
                except BufferError:  # the callback kept a derived view
                    pass
        return None

    def _attach_region(self, socket_path: str, region: RowRegion, timeout: float) -> None:
        try:
            conn = LocalConn(socket_path, timeout)
        except OSError as exc:
            self.region_reason = f"cannot connect to hand over the region ({exc})"
            return
        try:
            reply = conn.call({"op": "attach_region", "instance": self.instance,
                               "offset": region.file.offset, "row_stride": region.row_stride,
                               "num_rows": region.num_rows, "chunk_bytes": region.chunk_bytes},
                              timeout, fd=region.file.fd)
        except (Late, OSError, ValueError) as exc:
            conn.close()
            self.region_reason = f"the sidecar did not take the region ({exc or 'late'})"
            return
        if not reply.get("ok") or not isinstance(reply.get("region"), int):
            conn.close()
            self.region_reason = f"the sidecar refused the region: {reply.get('error')}"
            return
        self._region_conn, self.region_id, self.region_reason = conn, int(reply["region"]), ""

    def close(self) -> None:
        if self._region_conn is not None:
            self._region_conn.close()  # the sidecar unmaps the region once its jobs end
            self._region_conn = None
        try:
            self.view.close()
        except BufferError:  # a callback still holds a view: the mapping goes with it
            pass


__all__ = ["Attachment", "Late", "LocalConn", "RowRegion"]
