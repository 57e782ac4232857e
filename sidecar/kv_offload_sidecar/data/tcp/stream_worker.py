"""A plain data connection's own thread: chunk bytes moved off the event loop.

A chunk's bytes are the plane's whole cost: receiving them (a copy out of the kernel), hashing
them and sending them (a copy into it). On the event loop they ran on one thread with the rest
of the sidecar, so one connection could use one core at most and every other request (a
``/healthz`` poll, a lookup, the directory) waited behind each piece. ``StreamWorker`` runs
those large transfers on a thread of the connection's own: the socket calls and the hash
release the GIL, so lanes (``data.lanes``) on several connections spread over the cores.

Receiving and hashing a chunk on one thread makes a lane as slow as the two together: on the
H200 host one lane moved 3.1 GB/s (0.82x raw TCP's one stream) with its fetcher busy 1.16
CPU-seconds per second, its receive (about 0.2 CPU-s/GB) waiting for each piece's hash
(about 0.15 at XXH3's 6.7 GB/s there). Where the process may use a second core
(``spare_core``), each piece that landed is hashed on the connection's second thread while
the next one is received, and the last one, which the chunk waits for anyway, on the
receiving thread (a chunk of one piece never leaves it); with one core the two would only
take turns, so every piece is hashed on the receiving thread as before.

Contract:
- One transfer at a time per direction's owner (the connection's reader, or its writer); the
  loop awaits it, and nothing else touches the socket in that direction meanwhile.
- ``stop()`` (from the loop's thread) returns only once the thread can no longer touch the
  buffer it was given: it sets a flag, wakes the thread (``shutdown``) and waits for the one
  socket call in progress, if any, to end (a non-blocking call: microseconds to a piece's
  copy). So a row a load job offered is not written after the job ended, and a slot is not
  read after its pin was released.
- A transfer awaited by a task that is cancelled, or that fails, stops the thread the same
  way before the exception leaves ``run``: when ``run`` returns or raises, the buffers are free.
- Hashing is stopped the same way, on either thread: ``stop()`` also waits for the piece
  being hashed, if any (``_hash_lock``), and no piece is hashed after it; a receive returns
  only once every piece it handed over is hashed, and raises ``StreamStopped`` when one was
  skipped (its digest would be wrong, not the bytes).
- ``run``'s result reaches the loop through the loop's ``LoopWakes``: transfers that finish
  on any connection's thread before the loop runs share one wake-up of it.
- The socket calls themselves are ``recv_some`` and ``send_views``: a plain socket's here, a
  TLS socket's in ``tls_stream.TlsWorker`` (whose loop-side calls take the same ``lock``, as
  an OpenSSL connection must not be used by two threads at once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import select
import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kv_offload_sidecar.cpu_budget import cpu_budget
from kv_offload_sidecar.data.base import ReceiveStopped
from kv_offload_sidecar.data.write_gates import WriteGate

# Transfers of at least this many bytes run on the connection's thread; smaller ones (frames,
# headers, small chunks) stay on the loop, where a thread hop would cost more than the copy.
OFF_LOOP_BYTES = 1 << 20

# Milliseconds one poll waits before the thread looks at its stop flag again (a stop also
# wakes it at once through ``shutdown``; this bounds the wait when it raced the poll).
POLL_MILLISECONDS = 50


def spare_core() -> bool:
    """Whether this process's CPU budget has more than one core (``cpu_budget``, read
    once): only then does a hash handed to another thread run beside
    the work it was taken from instead of taking turns with it."""
    return cpu_budget().cpus > 1


def send_some(sock: socket.socket, views: list[memoryview]) -> int:
    """One gathered ``sendmsg`` of ``views`` on a non-blocking socket: the bytes it took (0
    when the socket buffer is full)."""
    try:
        return sock.sendmsg(views)
    except (BlockingIOError, InterruptedError):
        return 0


def drop_sent(views: list[memoryview], sent: int) -> None:
    """Take the ``sent`` bytes a gathered send took off the front of ``views`` (released)."""
    while sent and views:
        first = views[0]
        if sent >= len(first):
            sent -= len(first)
            views.pop(0).release()
        else:
            views[0] = first[sent:]
            first.release()
            sent = 0


class LoopWakes:
    """Transfers finished on the connections' threads, handed to one event loop in batches: the
    first of a batch wakes the loop (``call_soon_threadsafe``), those that finish before it ran
    join that wake. With lanes on few cores a loop woken once per chunk of each lane spent its
    turns on the wake-ups (a write and a read of its self-pipe and an epoll return each)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        # (future, result, error) finished and not yet handed to the loop.
        self._done: list[tuple[asyncio.Future[object], object, BaseException | None]] = []

    def post(self, fut: asyncio.Future[object], result: object, error: BaseException | None) -> None:
        """(Any thread.) ``fut`` gets ``result`` (or ``error``) on the loop, soon."""
        with self._lock:
            first = not self._done
            self._done.append((fut, result, error))
        if first:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for fut, result, error in done:
            if fut.done():  # its task was cancelled meanwhile
                continue
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)


_wakes_lock = threading.Lock()
# Event loop -> its LoopWakes.
_wakes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWakes] = weakref.WeakKeyDictionary()


def loop_wakes(loop: asyncio.AbstractEventLoop) -> LoopWakes:
    """The ``LoopWakes`` of ``loop`` (made at first use)."""
    with _wakes_lock:
        wakes = _wakes.get(loop)
        if wakes is None:
            wakes = _wakes[loop] = LoopWakes(loop)
        return wakes


class StreamStopped(ReceiveStopped):
    """The connection's thread was stopped while a transfer was under way."""


class StreamWorker:
    """The thread of one socket, and the lock that makes ``stop`` wait for its last call."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self._sock = sock
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        # The second thread, hashing received pieces (made at the first one handed over).
        self._hasher: ThreadPoolExecutor | None = None
        # Held by the thread around each socket call that touches a transfer's buffer.
        self.lock = threading.Lock()
        # Held around each piece hashed, on either thread.
        self._hash_lock = threading.Lock()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def run(self, work: Callable[[], object]) -> object:
        """Run ``work`` (``self.receive``/``self.send`` bound by the caller) on the thread."""
        if self._stopped:
            raise StreamStopped("the connection was stopped")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        wakes = loop_wakes(loop)

        def job() -> None:
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task)
                wakes.post(fut, None, exc)
            else:
                wakes.post(fut, result, None)

        self._executor.submit(job)
        try:
            return await fut
        except BaseException:
            self.stop()
            raise

    def stop(self, *, shutdown: bool = True) -> None:
        """Stop the thread's transfers for good; returns once no socket call is under way.
        ``shutdown``: also end both directions of the socket, which wakes a waiting thread
        at once (without it, the thread sees the flag within ``POLL_MILLISECONDS``)."""
        if not self._stopped:
            self._stopped = True
            if shutdown:
                with contextlib.suppress(OSError):
                    # The plain socket's shutdown: an SSLSocket's own drops its TLS state.
                    socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        with self.lock:  # the call in progress, if any, ends; none starts after it
            pass
        with self._hash_lock:  # the piece being hashed, if any, is done; none starts after it
            pass
        for executor in (self._executor, self._hasher):
            if executor is not None:
                executor.shutdown(wait=False)

    def receive(self, view: memoryview, piece_bytes: int, batch_bytes: int,
                on_piece: Callable[[memoryview], object] | None, gate: WriteGate | None = None) -> None:
        """(On the thread.) Fill ``view`` from the socket, ``on_piece`` called with each
        ``piece_bytes`` (or the rest) in order right after they landed, still in the cache:
        on the hashing thread while the next piece arrives when there is a ``spare_core``
        (the last one here, once the others are done), else all here; ConnectionError on EOF,
        ``StreamStopped`` once stopped. ``gate``: each receive into ``view`` is made under it
        (``write_gates``), so none starts past the transfer's deadline whatever the loop does;
        ``LateWrite`` then, and the thread stops (the rest of the chunk is never read)."""
        sock, got, n, done = self._sock, 0, len(view), 0
        poller, events = select.poll(), select.POLLIN
        poller.register(sock.fileno(), events)
        lowat = 1
        beside = on_piece is not None and spare_core()
        handed: list[concurrent.futures.Future[bool]] = []
        try:
            while got < n:
                want = max(1, min(n - got, batch_bytes))
                if batch_bytes and want != lowat:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                with self.lock, view[got:min(n, got + piece_bytes)] as target:
                    if self._stopped:
                        raise StreamStopped("the connection was stopped mid-chunk")
                    if gate is None:
                        k, wait = self.recv_some(target)
                    else:
                        with gate.writing(len(target)):
                            k, wait = self.recv_some(target)
                if wait:  # nothing there yet: sleep until the batch has arrived
                    if wait != events:
                        poller.modify(sock.fileno(), events := wait)
                    self._wait(poller, gate)
                    continue
                if k == 0:
                    raise ConnectionError(f"connection closed after {got} of {n} bytes")
                got += k
                if on_piece is not None and (got - done >= piece_bytes or got == n):
                    if beside and got < n:
                        handed.append(self._hand_over(on_piece, view[done:got]))
                    else:  # the last piece is waited for anyway: hashed here, after the others
                        concurrent.futures.wait(handed)
                        if not self._hash_piece(on_piece, view[done:got]):
                            raise StreamStopped("the connection was stopped mid-chunk")
                    done = got
        finally:
            if lowat != 1:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            concurrent.futures.wait(handed)  # no piece of ``view`` is hashed after this
        if not all(fut.result() for fut in handed):
            raise StreamStopped("the connection was stopped while a piece was being hashed")

    def receive_then(self, view: memoryview, piece_bytes: int, batch_bytes: int,
                     on_piece: Callable[[memoryview], object] | None, gate: WriteGate | None,
                     then: Callable[[StreamWorker], object] | None) -> object:
        """(On the thread.) ``receive``, then ``then(self)`` when given: its result."""
        self.receive(view, piece_bytes, batch_bytes, on_piece, gate)
        return None if then is None else then(self)

    def _hand_over(self, on_piece: Callable[[memoryview], object],
                   piece: memoryview) -> concurrent.futures.Future[bool]:
        """Queue ``on_piece(piece)`` on the hashing thread (pieces run in the order given)."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name + "-hash")
        try:
            return self._hasher.submit(self._hash_piece, on_piece, piece)
        except RuntimeError:  # shut down by stop() since the piece landed
            piece.release()
            raise StreamStopped("the connection was stopped mid-chunk") from None

    def _hash_piece(self, on_piece: Callable[[memoryview], object], piece: memoryview) -> bool:
        """``on_piece(piece)`` (on either thread); False, untouched, once stopped."""
        try:
            with self._hash_lock:
                if self._stopped:
                    return False
                on_piece(piece)
                return True
        finally:
            piece.release()

    def send(self, buffers: Sequence) -> None:
        """(On the thread.) Send ``buffers`` in order (``send_views`` calls)."""
        sock = self._sock
        views = [memoryview(b) for b in buffers if len(b)]
        poller, events = select.poll(), select.POLLOUT
        poller.register(sock.fileno(), events)
        try:
            while views:
                with self.lock:
                    if self._stopped:
                        raise StreamStopped("the connection was stopped mid-send")
                    sent, wait = self.send_views(views)
                drop_sent(views, sent)
                if wait:
                    if wait != events:
                        poller.modify(sock.fileno(), events := wait)
                    self._wait(poller)
        finally:
            for v in views:
                v.release()

    # ---- one socket call each (under ``lock``): what differs between plain and TLS

    def recv_some(self, view: memoryview) -> tuple[int, int]:
        """One receive into ``view``: (bytes landed, 0) with 0 bytes at EOF, or (0, the poll
        events to wait for) when nothing can be read yet."""
        try:
            return self._sock.recv_into(view), 0
        except (BlockingIOError, InterruptedError):
            return 0, select.POLLIN

    def send_views(self, views: list[memoryview]) -> tuple[int, int]:
        """One gathered send of ``views``: (bytes taken, 0), or (0, the poll events to wait
        for) when the socket takes nothing now."""
        sent = send_some(self._sock, views)
        return sent, (0 if sent else select.POLLOUT)

    def _wait(self, poller: select.poll, gate: WriteGate | None = None) -> bool:
        """Poll once; True when the socket is ready (or in error: the next call says which).
        ``gate``: ``LateWrite`` once it is shut (the thread ends at the deadline, not when the
        peer sends again)."""
        if self._stopped:
            raise StreamStopped("the connection was stopped")
        if gate is not None and not gate.open():
            gate.check()
        return bool(poller.poll(POLL_MILLISECONDS))


__all__ = ["OFF_LOOP_BYTES", "POLL_MILLISECONDS", "StreamStopped", "StreamWorker", "drop_sent", "send_some",
           "spare_core"]
