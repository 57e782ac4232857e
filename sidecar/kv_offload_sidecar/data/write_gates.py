"""When a transfer's bytes may still land in what it writes into: a store slot reserved for a
fetch, or a row of vLLM's a load job offered (``peers.row_landings``).

Both are lent, each until a deadline: a slot until its fetch's deadline (then it is aborted and
reused), a row until its load job's (then the tier gives up and vLLM reuses the row for another
request). The event loop ends a transfer by stopping the thread that moves its bytes; but a loop
that is late (CPU throttling, a long pause, SIGSTOP/SIGCONT of the sidecar) ends nothing, while
the threads writing into slots and rows (a TCP or TLS connection's thread, a NIXL lane) and the
loop's own receives once it resumes go on. A ``WriteGate`` is the transfer's own deadline, which
the writer checks itself before each write, whatever the loop is doing.

Contract:
- Every write into a transfer's target is made under its gate (``with gate.writing(n):``, one
  ``recv_into``, piece or READ at a time): it raises ``LateWrite`` instead, without touching
  the target, once the gate is revoked or less than ``MARGIN_SECONDS`` are left before its
  deadline (a write started then ends well before the deadline: one piece's copy).
- ``revoke()`` (any thread; the loop when a fetch fails or a load job ends) returns only once
  no write is in progress, and none starts after it: the slot or row can then be handed back.
- ``tighten(deadline)``: a row's job may end before the fetch that fills it (``Landing.take``).
- Counted process-wide (``late_writes()``, for tests and the chaos bench) and per gate: writes
  refused past the deadline, and bytes of a write that ended past it anyway (a writer
  descheduled mid-copy for longer than the margin; zero is the invariant the tests hold).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kv_offload_sidecar.data.base import ReceiveStopped

# Seconds before its deadline past which a gate refuses a new write: far above one piece's
# copy (4 MiB out of the kernel: about half a millisecond), far below any deadline.
MARGIN_SECONDS = 0.01


class LateWrite(ReceiveStopped):
    """A write into a slot or a row was refused: its transfer was given up or is past its
    deadline. This side's doing (its deadline), not the holder's fault."""


@dataclass
class LateWriteCounts:
    """Process-wide counts of the gates' refusals (``late_writes()``)."""

    # Writes refused because less than MARGIN_SECONDS were left before the deadline.
    refused_past_deadline: int = 0
    # Writes refused because the transfer had been given up (revoked) before its deadline.
    refused_revoked: int = 0
    # Bytes of writes that ended after their deadline (must stay 0).
    bytes_after_deadline: int = 0


_counts = LateWriteCounts()
_counts_lock = threading.Lock()


def late_writes() -> LateWriteCounts:
    """A copy of this process's counts so far."""
    with _counts_lock:
        return LateWriteCounts(**vars(_counts))


class WriteGate:
    """The right of one transfer's writer to write into its target, until a deadline."""

    def __init__(self, deadline: float = math.inf) -> None:
        # time.monotonic() past which (less the margin) no write starts.
        self.deadline = deadline
        # Writes this gate refused past its deadline (not counting revocations).
        self.refused = 0
        # Bytes of writes that ended after the deadline (see the module docstring).
        self.bytes_after_deadline = 0
        self._lock = threading.Lock()
        self._revoked = False

    @property
    def revoked(self) -> bool:
        return self._revoked

    def tighten(self, deadline: float) -> None:
        """Bring the deadline forward to ``deadline`` (never back)."""
        with self._lock:
            self.deadline = min(self.deadline, deadline)

    def open(self, deadline: float = math.inf) -> bool:
        """Whether a write could start now, were the deadline brought forward to ``deadline``
        (a hint: only ``writing`` decides)."""
        return not self._revoked and time.monotonic() < min(self.deadline, deadline) - MARGIN_SECONDS

    @contextlib.contextmanager
    def writing(self, nbytes: int) -> Iterator[None]:
        """Hold the gate around one write of at most ``nbytes``; ``LateWrite`` when it is shut."""
        with self._lock:
            if self._revoked:
                with _counts_lock:
                    _counts.refused_revoked += 1
                raise LateWrite("the transfer was given up; its target is no longer written")
            if time.monotonic() >= self.deadline - MARGIN_SECONDS:
                self.refused += 1
                with _counts_lock:
                    _counts.refused_past_deadline += 1
                raise LateWrite("the transfer reached its deadline; its target is no longer written")
            yield
            if time.monotonic() > self.deadline:
                self.bytes_after_deadline += nbytes
                with _counts_lock:
                    _counts.bytes_after_deadline += nbytes

    def check(self) -> None:
        """``LateWrite`` now when a write could not start (``writing`` for no bytes)."""
        with self.writing(0):
            pass

    def revoke(self) -> None:
        """No write after this: returns once the one in progress, if any, ended."""
        with self._lock:
            self._revoked = True


__all__ = ["MARGIN_SECONDS", "LateWrite", "LateWriteCounts", "WriteGate", "late_writes"]
