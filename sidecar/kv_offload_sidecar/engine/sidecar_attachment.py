"""What the engine client holds of one sidecar: local-channel connections and the attachment.

``LocalConn`` is one blocking connection of the local channel (frames of
``channel_protocol``; a frame may carry one descriptor). ``Attachment`` is
what the client holds of one sidecar instance: its mapped store file and, when
the engine offered its primary rows (``RowRegion``), the region handed over on
a connection kept open for the attachment's life (the sidecar unmaps it when
that connection closes). Standard library only.

Letting go of a dead sidecar's store: the attachment keeps one connection open for
its life (the region's, else an idle one that sends nothing) and a daemon thread
waits on it. When it ends without the client closing it (the sidecar exited,
was killed, or dropped it), the attachment is ``gone``: it tells the client
(``on_gone``: re-attach at the next call) and unmaps the store file as soon as
no ``each_slot`` copy is running (at once when none is); a copy that starts
after that raises ``ConnectionError`` (the client's miss) instead of touching
the file. So a sidecar restarted into a ``/dev/shm`` that holds one store gets
the dead store's pages back (``store.shm_file``), and the tier never reads or
writes the new store through the old mapping: the new sidecar's file is another
inode, and each request names the instance it was mapped for.
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.engine.region_file import RegionFile
from kv_offload_sidecar.engine.store_view import ChunkStoreView


# Seconds ``Attachment.close`` waits for its watch thread to end (it ends at once).
WATCH_JOIN_SECONDS = 2.0


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


def _shut(sock: socket.socket) -> None:
    """End ``sock`` for a thread blocked reading it (close alone does not wake it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _watch(sock: socket.socket, ref: "weakref.ref[Attachment]") -> None:
    """Wait for the end of the attachment's held connection (the sidecar sends nothing on it)."""
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    att = ref()
    if att is not None:
        att._gone()


class Attachment:
    """The mapped store of one sidecar instance, and the engine region handed to it."""

    def __init__(self, info: Mapping[str, Any], socket_path: str, region: RowRegion | None,
                 timeout: float, on_gone: Callable[[], None] | None = None) -> None:
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
        # Set when the held connection ended without ``close``: the sidecar went away.
        self.gone = False
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._copies = 0  # each_slot calls running (the mapping stays until they end)
        self._closed = self._unmapped = False
        if region is not None:
            self._attach_region(socket_path, region, timeout)
        self._held = self._region_conn or self._idle_conn(socket_path, timeout)
        if self._held is not None:
            self._held.sock.settimeout(None)
            self._shutter = weakref.finalize(self, _shut, self._held.sock)
            self._watcher = threading.Thread(target=_watch, args=(self._held.sock, weakref.ref(self)),
                                             name=f"kv-offload store watch {self.instance}", daemon=True)
            self._watcher.start()

    @staticmethod
    def _idle_conn(socket_path: str, timeout: float) -> LocalConn | None:
        try:
            return LocalConn(socket_path, timeout)
        except OSError:
            return None  # not watched: the client notices the restart at a call

    def _gone(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.gone = True
            unmap = self._unmap_now_locked()
        if self._on_gone is not None:
            self._on_gone()
        if unmap:
            self._unmap()

    def _unmap_now_locked(self) -> bool:
        """Whether the caller unmaps now (no copy runs, not unmapped yet); no copy starts after."""
        if self._copies or self._unmapped:
            return False
        self._unmapped = True
        return True

    def _unmap(self) -> None:
        try:
            self.view.close()
        except BufferError:  # a callback still holds a view: the mapping goes with it
            pass

    def each_slot(self, slots: Sequence[int | None],
                  fn: Callable[[int, memoryview], None]) -> BaseException | None:
        """``fn(i, view of slots[i])`` for each slot (None: skipped) until one raises; returns
        that error of the engine's own (the caller gives the slots back, then raises it);
        ConnectionError when the store was let go (``gone``, or closed) and a slot is to be read
        (an answer of no slots, a load the sidecar answered empty while it stopped, reads none)."""
        if not any(slot is not None for slot in slots):
            return None
        with self._lock:
            if self._unmapped:
                raise ConnectionError(f"the store of sidecar {self.instance} was let go "
                                      "(its sidecar went away)")
            self._copies += 1
        try:
            return self._each_slot(slots, fn)
        finally:
            with self._lock:
                self._copies -= 1
                unmap = (self.gone or self._closed) and self._unmap_now_locked()
            if unmap:
                self._unmap()

    def _each_slot(self, slots: Sequence[int | None],
                   fn: Callable[[int, memoryview], None]) -> BaseException | None:
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
        """Drop the held connection (the sidecar unmaps the region once its jobs end) and
        unmap the store, at once or when the running copies end."""
        with self._lock:
            self._closed = True
            unmap = self._unmap_now_locked()
        if self._held is not None:
            self._shutter()  # wakes the watch thread, which sees ``_closed`` and ends
            self._held.close()
            self._region_conn = None
            if self._watcher is not threading.current_thread():
                self._watcher.join(WATCH_JOIN_SECONDS)  # a closed client leaves no thread
        if unmap:
            self._unmap()


__all__ = ["Attachment", "Late", "LocalConn", "RowRegion"]
