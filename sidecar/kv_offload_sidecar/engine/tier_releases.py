"""Loads the tier gave up on while the sidecar may still write into vLLM's rows (vLLM 0.34+).

The sidecar copies loaded chunks into vLLM's primary rows itself, and its answer to
``load_rows`` is its proof that no byte lands in them any more (the receive stopped,
the copy thread done: ``engine.channel_protocol``). A sidecar that has not answered by
the load's deadline plus ``ROW_COPY_GRACE_SECONDS`` is stalled: the tier reports the
load failed, and from vLLM 0.34 on with ``JobResult.deferred_release``, an event vLLM
waits for before it reuses the rows. ``DeferredReleases`` keeps the unanswered
connections and sets each job's event once no byte can land: its answer came, or the
connection ended (the sidecar process is gone, and with it its mapping of the rows).
One thread waits on all of them (``selectors``), started with the first.

``release_all(wait)`` (``drain_jobs``, shutdown) waits up to ``wait`` seconds for the
answers still due and then sets every event anyway, one warning naming how many: vLLM
requires every event set when ``drain_jobs`` returns, so a sidecar stalled for good
cannot hold ``reset_cache`` past that bound (the rows are then reused while a resumed
sidecar could still finish the copy piece it was in, at most 32 MiB per job; the same
exposure releases before 0.34 have at every late load). Standard library only.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any

from kv_offload_sidecar.engine.vllm_contract import tier_logger

logger = tier_logger(__name__)


class DeferredReleases:
    """The unanswered ``load_rows`` connections of one tier and their jobs' release events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # connection -> (the job's release event, when it was deferred)
        self._pending: dict[Any, tuple[threading.Event, float]] = {}
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Events set because release_all gave up waiting (the sidecar never answered).
        self.forced = 0

    def defer(self, conn: Any) -> threading.Event:
        """The release event of the job whose answer is due on ``conn`` (a ``LocalConn``, now
        owned here): set once the answer or the connection's end arrives."""
        event = threading.Event()
        with self._lock:
            if self._closed:
                conn.close()
                event.set()
                return event
            self._start()
            assert self._selector is not None and self._wake_w is not None
            self._pending[conn] = (event, time.monotonic())
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            self._wake_w.send(b"\0")
        return event

    @property
    def pending(self) -> int:
        """Jobs whose release still waits for their sidecar."""
        with self._lock:
            return len(self._pending)

    def release_all(self, wait: float) -> None:
        """Every event set: the answers that come within ``wait`` seconds end theirs, the
        others are set regardless (counted in ``forced``, one warning)."""
        deadline = time.monotonic() + wait
        while self.pending and time.monotonic() < deadline:
            with self._lock:
                events = [event for event, _ in self._pending.values()]
            if events:
                events[0].wait(max(0.0, min(0.05, deadline - time.monotonic())))
        with self._lock:
            left = list(self._pending)
            for conn in left:
                self._end(conn)
            self.forced += len(left)
        if left:
            logger.warning("kv-offload: %d failed load(s) still unanswered by a stalled sidecar "
                           "after %.1f s more; vLLM may reuse their rows now", len(left), wait)

    def close(self) -> None:
        """Set every event (no wait), stop the thread."""
        self.release_all(0.0)
        with self._lock:
            self._closed = True
            thread, wake = self._thread, self._wake_w
            if wake is not None:
                wake.send(b"\0")
        if thread is not None:
            thread.join()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._selector is not None:
            self._selector.close()

    def _start(self) -> None:
        """The waiting thread and its wake-up pair, at the first deferral (under the lock)."""
        if self._thread is not None:
            return
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="kv-offload-releases", daemon=True)
        self._thread.start()

    def _end(self, conn: Any) -> None:
        """Set ``conn``'s event and close it (under the lock)."""
        event, _ = self._pending.pop(conn)
        assert self._selector is not None
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.close()
        event.set()

    def _run(self) -> None:
        assert self._selector is not None and self._wake_r is not None
        while True:
            for key, _ in self._selector.select():
                conn = key.data
                if conn is None:
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    continue
                # Readable: the answer (any byte of it) or the end of the connection.
                with self._lock:
                    if conn in self._pending:
                        self._end(conn)
            with self._lock:
                if self._closed:
                    return


__all__ = ["DeferredReleases"]
