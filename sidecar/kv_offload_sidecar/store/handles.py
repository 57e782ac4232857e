"""What the store hands out: a write reservation (a slot that becomes a visible chunk only
when its checksum is committed) and a pin (a visible chunk that cannot be evicted while held).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from kv_offload_sidecar.store.chunk_store import ChunkStore


class WriteReservation:
    """A slot reserved for one key; the chunk becomes visible only at ``commit``.

    Write (or ``recv_into``) the chunk's ``slot_bytes`` into ``view`` and call
    ``commit(expected_checksum)``. ``abort()`` frees the slot. As a context
    manager, leaving without commit aborts. After commit/abort ``view`` is
    released and raises on use.
    """

    def __init__(self, store: ChunkStore, key: bytes, slot: int, view: memoryview) -> None:
        self._store = store
        self.key = key
        # Slot index in the store file.
        self.slot = slot
        # Writable view of exactly slot_bytes.
        self.view = view
        # Why the last commit failed for a reason of this side's (None: it did not, or the
        # bytes failed their checksum).
        self.refused: str | None = None
        self._done = False

    def commit(self, expected_checksum: int | None = None, *, computed_checksum: int | None = None) -> bool:
        """Checksum the slot and make the chunk visible.

        With ``expected_checksum`` (a received chunk) a mismatch counts an
        integrity failure, frees the slot and returns False. Returns False too
        when the reservation already ended or the store closed.
        ``computed_checksum``: the XXH3-64 the caller already computed over the slot
        after its last write (a transport that hashed the bytes piece by piece as they
        landed); the slot is then not hashed a second time.
        """
        if self._done:
            self.refused = "its slot reservation had already ended"
            return False
        self._done = True
        try:
            checksum = (self._store._checksum(self.view) if computed_checksum is None
                        else int(computed_checksum))
        except TypeError:  # the caller released the view: nothing trustworthy to publish
            self._store._finish_write(self.key, self.slot, None)
            self.refused = "its slot's view was released"
            return False
        if expected_checksum is not None and checksum != expected_checksum:
            self._store.count_integrity_failure()
            self._store._finish_write(self.key, self.slot, None)
            self._release_view()
            return False
        ok = self._store._finish_write(self.key, self.slot, checksum)
        if not ok:
            self.refused = ("the store is closed" if self._store.closed
                            else "its slot reservation had already ended")
        self._release_view()
        return ok

    def receive_view(self, stop: Callable[[], None], gate: object = None) -> memoryview:
        """Where a transport receives the chunk: the slot (``stop`` and ``gate`` are not needed
        here; see ``peers.row_landings``, whose reservations may answer a row of vLLM's instead)."""
        return self.view

    def abort(self) -> None:
        """Free the slot; the key stays invisible. Idempotent."""
        if self._done:
            return
        self._done = True
        self._store._finish_write(self.key, self.slot, None)
        self._release_view()

    @property
    def done(self) -> bool:
        return self._done

    def __del__(self) -> None:
        # A reservation lost by its caller must not hold its slot forever.
        if not getattr(self, "_done", True):
            self._store._dropped_handle("write", self.key, self.slot)

    def _release_view(self) -> None:
        try:
            self.view.release()
        except BufferError:  # the caller still holds a derived buffer
            pass

    def __enter__(self) -> WriteReservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class PinnedChunk:
    """A visible chunk held in place while it is sent or read.

    ``view`` is the slot's bytes (treat as read-only); ``release()`` (or leaving
    the ``with`` block) drops the pin and releases ``view``.
    """

    def __init__(
        self, store: ChunkStore, key: bytes, slot: int, checksum: int, view: memoryview
    ) -> None:
        self._store = store
        self.key = key
        # Slot index in the store file.
        self.slot = slot
        # XXH3-64 of the chunk, computed or verified at commit.
        self.checksum = checksum
        # View of exactly slot_bytes.
        self.view = view
        self._released = False

    def release(self) -> None:
        """Drop the pin. Idempotent."""
        if self._released:
            return
        self._released = True
        self._store._unpin(self.key)
        try:
            self.view.release()
        except BufferError:
            pass

    def __del__(self) -> None:
        # A pin lost by its caller must not keep its chunk unevictable forever.
        if not getattr(self, "_released", True):
            self._store._dropped_handle("pin", self.key, self.slot)

    def __enter__(self) -> PinnedChunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
