"""Inbound sessions: the peers that proved the pool key to this sidecar.

A session authorises the peer's data connections and its directory messages
(``POST /v1/publish`` and ``/v1/locate``). It was made with one pool key
(``Session.key_id``); when this sidecar retires that key (the rotation
finished), the session keeps working for ``RETIRE_GRACE_SECONDS`` and then
ends. Directory replies to a session whose key is not this sidecar's current
one carry ``REKEY_HEADER``, and the peer handshakes again with the current key
before dropping the old session (make before break, ``links.PeerManager``), so
a rotation costs no miss.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kv_offload_sidecar.peers.handshake import Session

# Inbound sessions kept (oldest dropped first); each peer keeps a few.
MAX_INBOUND_SESSIONS = 4096
# Seconds a session made with a retired key keeps working (time for its peer to re-key).
RETIRE_GRACE_SECONDS = 30.0
# Directory-reply header asking the peer to handshake again with the current key.
REKEY_HEADER = "X-KV-Offload-Rekey"


class InboundSessions:
    """Session id -> inbound ``Session``, bounded, aware of retired keys."""

    def __init__(self, limit: int = MAX_INBOUND_SESSIONS) -> None:
        self._limit = limit
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        # key id -> monotonic time after which its sessions are refused
        self._retired: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: Session) -> None:
        self._sessions[session.session_id] = session
        while len(self._sessions) > self._limit:
            self._sessions.popitem(last=False)

    def get(self, session_id: bytes) -> Session | None:
        """The live session, or None (unknown, or its key retired past the grace)."""
        session = self._sessions.get(bytes(session_id))
        if session is None:
            return None
        deadline = self._retired.get(session.key_id)
        if deadline is not None and time.monotonic() >= deadline:
            del self._sessions[session.session_id]
            return None
        return session

    def retire(self, key_ids: list[bytes], grace_seconds: float = RETIRE_GRACE_SECONDS) -> int:
        """Sessions of these keys end after ``grace_seconds``; returns how many are affected."""
        deadline = time.monotonic() + grace_seconds
        for kid in key_ids:
            self._retired.setdefault(bytes(kid), deadline)
        # forget retirements nobody refers to any more
        used = {s.key_id for s in self._sessions.values()}
        for kid in [k for k, d in self._retired.items() if k not in used and d < time.monotonic()]:
            del self._retired[kid]
        return sum(1 for s in self._sessions.values() if s.key_id in key_ids)

    def peers(self) -> set[tuple[str, str]]:
        """(identity, control address) of the peers with a session."""
        return {(s.peer.identity, s.peer.control_address) for s in self._sessions.values()}

    def counts_by_key(self) -> dict[str, int]:
        """Live sessions per key id (hex), for /v1/status."""
        out: dict[str, int] = {}
        for s in self._sessions.values():
            out[s.key_id.hex()] = out.get(s.key_id.hex(), 0) + 1
        return out
