"""A lookup sent to the sidecar whose answer is read without blocking, on whichever thread polls.

Why: the tier's lookup thread would need the GIL to take the answer in, and
vLLM's scheduler thread, stepping without pause while a request waits, hands
it over only every switch interval (5 ms, several scheduler steps). So the
tier's lookup thread only sends (``EngineClient.lookup_start``), and vLLM's own
thread polls the answer once per step: one non-blocking ``recv`` on the
lookup's connection, no GIL hand-over between the sidecar's answer and HIT.

``poll()`` returns None until the whole answer frame is in, then the
``LookupReply`` (a miss, ``LookupReply(0, 0)``, for a refused, failed or late
lookup; the client counts those). ``ready()`` says whether a ``poll()`` would
have something to read. ``wait()`` blocks until the answer (the client's
blocking ``lookup``). One thread at a time. Standard library only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.engine.readiness import readable
from kv_offload_sidecar.engine.sidecar_attachment import Late, LocalConn

# Bytes read at once (a lookup's answer is one small frame).
_READ_BYTES = 1 << 16


@dataclass(frozen=True)
class LookupReply:
    """Hit prefix of a lookup: ``local`` chunks in the pod's store, then ``peer`` more on a peer."""

    # Leading keys held by this pod's sidecar.
    local: int
    # Keys after those that a peer holds (loaded on ``load``).
    peer: int
    # The sidecar's time.monotonic() when it knew the answer (None: a miss it never gave);
    # not part of the answer's equality.
    known_at: float | None = field(default=None, compare=False)

    @property
    def hits(self) -> int:
        return self.local + self.peer


MISS = LookupReply(0, 0)

# The client's end of a lookup: (the connection, or None once failed; the answer's JSON, or
# the failure) -> the reply. It takes the connection back (or closes it) and counts failures.
Finish = Callable[[LocalConn, "dict[str, Any] | BaseException"], LookupReply]


class PendingLookup:
    """One lookup on its own connection until its answer is read."""

    def __init__(self, conn: LocalConn | None, deadline: float, finish: Finish | None,
                 done: LookupReply | None = None) -> None:
        self._conn = conn
        # time.monotonic() past which the answer is late (a miss).
        self.deadline = deadline
        self._finish = finish
        self._done = done
        self._buf = bytearray()
        if conn is not None:
            conn.sock.setblocking(False)  # one recv per poll: no poll(2) with a timeout first

    @classmethod
    def answered(cls, reply: LookupReply) -> PendingLookup:
        """A lookup that needed no sidecar (no keys) or failed before it was sent."""
        return cls(None, 0.0, None, reply)

    def ready(self) -> bool:
        """Whether ``poll()`` would return the answer (it is in, the channel closed, or late)."""
        if self._done is not None or self._conn is None:
            return True
        return readable(self._conn.sock) or time.monotonic() > self.deadline

    def poll(self) -> LookupReply | None:
        """The answer once it is whole; None while it is not (one non-blocking read)."""
        if self._done is not None:
            return self._done
        conn = self._conn
        assert conn is not None and self._finish is not None
        try:
            try:
                data = conn.sock.recv(_READ_BYTES)
            except BlockingIOError:
                if time.monotonic() > self.deadline:
                    raise Late() from None
                return None
            if not data:
                raise ConnectionError("sidecar closed the local channel")
            self._buf += data
            head = cp.LENGTH.size
            if len(self._buf) < head:
                return None
            n = cp.frame_length(bytes(self._buf[:head]))
            if len(self._buf) < head + n:
                return None
            if len(self._buf) > head + n:
                raise ConnectionError("sidecar sent more than one answer")
            answer: dict[str, Any] | BaseException = cp.decode_body(bytes(self._buf[head:]))
            if not isinstance(answer, dict):
                answer = ConnectionError("sidecar reply is not a JSON object")
        except (Late, OSError, ValueError) as exc:
            answer = exc
        self._conn = None
        self._done = self._finish(conn, answer)
        return self._done

    def wait(self) -> LookupReply:
        """Block until the answer (or the deadline)."""
        while (reply := self.poll()) is None:
            assert self._conn is not None
            readable(self._conn.sock, max(0.0, self.deadline - time.monotonic()))
        return reply

    def close(self) -> None:
        """Give up on the answer (its connection is closed, never reused)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._done = MISS


__all__ = ["MISS", "LookupReply", "PendingLookup"]
