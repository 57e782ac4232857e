"""What the planes' servers share: the session check that opens every connection (the
nonce sent, the client's proof checked with ``base.auth_proof``), the deadline of a chunk's
send, a stopping server's grace, unexpected errors told in one line, what every server keeps
around its connections (``SessionServer``: its loops, its limits, its refusals), and the rules
of the authenticated connections (``ProvenConnections``):

- at most ``per_session`` of them per session (a peer's link holds one session, two while it
  re-keys): the lanes this sidecar offers plus ``SESSION_CONNECTION_MARGIN``
  (``DEFAULT_CONNECTIONS_PER_SESSION``: the most any client may ask); one more is refused at
  its proof with ``ERROR too_many_connections`` and counted;
- at most ``MAX_SERVED_SESSIONS`` sessions with connections at once (the readers this sidecar
  serves, as many as a reader keeps data links to holders): a connection of one more session
  is refused the same way; the reader takes it as a busy holder (``base.PeerBusy``: a miss,
  the holder not blamed), and what it then computes itself it holds and publishes, so a chunk
  more pods want than its holder serves gains holders. Readers close idle links (10 s), which
  frees their places;
- every ``SWEEP_SECONDS`` a server ends (counted and logged like a refusal) the connections
  whose session ended, i.e. its pool key was retired and the grace passed
  (``peers.sessions.RETIRE_GRACE_SECONDS``): within the grace plus ``SWEEP_SECONDS``; reason
  ``unauthenticated``;
- and those that received nothing, not even the heartbeat their client sends every
  ``peers.liveness.HEARTBEAT_SECONDS``, for ``SILENT_CLOSE_SECONDS``: an idle connection
  nobody pings (a client gone behind a partition, a replaced connection left open) is closed
  within ``SILENT_CLOSE_SECONDS + SWEEP_SECONDS`` (5.5 s; its link reconnects on demand);
  reason ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import Authorize, DataPlaneServer, StoreLike, auth_proof
from kv_offload_sidecar.data.before_auth import DEFAULT_AUTH_TIMEOUT, CountsStrangers, StrangerLimit, refuse
from kv_offload_sidecar.rejections import RejectionLog, clip
from kv_offload_sidecar.settings import MAX_DATA_LANES

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Seconds the server waits for one chunk to leave before giving up on a client.
DEFAULT_SEND_TIMEOUT = 30.0
# Seconds an authenticated connection may receive nothing (not even a heartbeat) before it is closed.
SILENT_CLOSE_SECONDS = 5.0
# Seconds between a server's sweeps of its authenticated connections.
SWEEP_SECONDS = 0.5
# Authenticated connections a session may hold beyond the lanes offered: the fetcher's control
# connection (``data.lanes``) and a reconnect overlapping.
SESSION_CONNECTION_MARGIN = 3
# Sessions that may hold authenticated connections at once (readers served together).
MAX_SERVED_SESSIONS = 64
# Authenticated connections per session unless the server is told its offer of lanes.
DEFAULT_CONNECTIONS_PER_SESSION = MAX_DATA_LANES + SESSION_CONNECTION_MARGIN


def make_nonce() -> bytes:
    """A fresh server challenge."""
    return secrets.token_bytes(proto.NONCE_BYTES)


def check_auth(authorize: Authorize, nonce: bytes, answer: proto.AuthResponse) -> None:
    """Raise ``ProtocolError('unauthenticated')`` unless the answer proves the session."""
    try:
        key = authorize(answer.session_id)
    except Exception as exc:  # a broken authorize callback must not crash the server
        log.error("data plane: the authorize callback failed: %s", describe(exc),
                  exc_info=log.isEnabledFor(logging.DEBUG))
        raise proto.ProtocolError("unauthenticated", "session check failed") from exc
    if not key or not hmac.compare_digest(auth_proof(key, nonce), answer.proof):
        raise proto.ProtocolError(
            "unauthenticated", "unknown session or wrong proof; handshake again on the control port")


async def wait_until_idle(tasks: Sized, connections: Mapping[Any, Any], grace_seconds: float) -> None:
    """A stopping server's grace: while ``tasks`` (connections being served) remain, wait
    until every one of ``connections`` says ``idle(now)``, for at most ``grace_seconds``."""
    deadline = time.monotonic() + grace_seconds
    while tasks and time.monotonic() < deadline:
        now = time.monotonic()
        if all(c.idle(now) for c in connections.values()):
            return
        await asyncio.sleep(0.05)


async def end_tasks(tasks: Iterable[asyncio.Task[None]]) -> None:
    """A stopping server's end: cancel each of ``tasks`` (the connections still served, as
    they are now) and wait until all have ended."""
    still = list(tasks)
    for task in still:
        task.cancel()
    if still:
        await asyncio.wait(still)


def describe(exc: BaseException) -> str:
    """An unexpected exception as one short line (its type and clipped text, no traceback)."""
    return f"{type(exc).__name__}: {clip(exc)}"


class ProvenConnections:
    """A server's authenticated connections by session: bounded per session, swept for ended
    sessions and silence (see the module). A connection is any object with ``session_id``
    and ``heard`` (the monotonic time it last received a frame)."""

    def __init__(self, authorize: Authorize, per_session: int = DEFAULT_CONNECTIONS_PER_SESSION,
                 max_sessions: int = MAX_SERVED_SESSIONS) -> None:
        if per_session < 1 or max_sessions < 1:
            raise ValueError(f"connections_per_session={per_session}, max_sessions={max_sessions}; "
                             "use at least 1 each")
        self._authorize = authorize
        self.per_session = per_session
        self.max_sessions = max_sessions
        self._by_session: dict[bytes, set[Any]] = {}

    def __len__(self) -> int:
        return sum(len(held) for held in self._by_session.values())

    def admit(self, conn: Any) -> None:
        """Count ``conn`` under its session; ``ProtocolError('too_many_connections')`` past a bound."""
        if bytes(conn.session_id) not in self._by_session and len(self._by_session) >= self.max_sessions:
            raise proto.ProtocolError(
                "too_many_connections", f"this holder serves {len(self._by_session)} peers' data connections, "
                f"the most it serves at once (MAX_SERVED_SESSIONS); ask again once one closed")
        held = self._by_session.setdefault(bytes(conn.session_id), set())
        if len(held) >= self.per_session:
            raise proto.ProtocolError(
                "too_many_connections", f"session {bytes(conn.session_id).hex()[:16]} already holds "
                f"{len(held)} data connections, the most one session may (connections_per_session="
                f"{self.per_session}: the lanes offered + {SESSION_CONNECTION_MARGIN})")
        held.add(conn)

    def leave(self, conn: Any) -> None:
        held = self._by_session.get(bytes(conn.session_id))
        if held is not None:
            held.discard(conn)
            if not held:
                del self._by_session[bytes(conn.session_id)]

    def to_end(self, now: float) -> Iterator[tuple[Any, str, str]]:
        """``(connection, reason, message)`` of each connection to end now."""
        for session_id, held in list(self._by_session.items()):
            try:
                ended = not self._authorize(session_id)
            except Exception:
                ended = True
            for conn in list(held):
                if ended:
                    yield conn, "unauthenticated", ("its session ended (the pool key it was made with "
                                                    "was retired); handshake again")
                elif now - conn.heard >= SILENT_CLOSE_SECONDS:
                    yield conn, "timeout", (f"nothing received for {SILENT_CLOSE_SECONDS:.3g}s, "
                                            "not even a heartbeat")


class SessionServer(CountsStrangers, DataPlaneServer):
    """What a plane's server keeps around its connections: the task accepting them and the
    one sweeping the proven ones (``_start_loops``, ``_stop_loops``), the bound on strangers
    (``_limit``) and on proven connections (``_proven``), and its refusals, counted and
    logged (``_refuse``). A plane says how a proven connection is ended (``_end_proven``) and
    how a source appears in log lines (``_log_source``)."""

    def __init__(self, store: StoreLike, authorize: Authorize, metrics: SidecarMetrics | None, *,
                 chunk_bytes: int, logger: logging.Logger, auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
                 send_timeout: float = DEFAULT_SEND_TIMEOUT, rejections: RejectionLog | None = None,
                 connections_per_session: int = DEFAULT_CONNECTIONS_PER_SESSION) -> None:
        super().__init__(store, authorize, metrics, chunk_bytes=chunk_bytes,
                         auth_timeout=auth_timeout, send_timeout=send_timeout)
        # Authenticated connections by session: bounded, swept for ended sessions and silence.
        self._proven = ProvenConnections(authorize, connections_per_session)
        self._accept_task: asyncio.Task[None] | None = None
        self._sweeper_task: asyncio.Task[None] | None = None
        # Connections not yet authenticated, per source and in all (bounded).
        self._limit = StrangerLimit()
        # Refusals' log lines: one per source and reason per interval, with a count (the
        # sidecar's own when it passes one, so its ports share one budget of lines).
        self._rejections = rejections if rejections is not None else RejectionLog(logger)
        self.address = ""

    def _log_source(self, source: str) -> str:
        """How ``source`` appears in rejection lines."""
        return source

    def _end_proven(self, conn: Any) -> None:
        """End ``conn``, a proven connection the sweep ended (already counted and left)."""
        raise NotImplementedError

    def _refuse(self, source: str, reason: str, detail: object) -> None:
        """Count one refusal of a connection from ``source`` and note it in the log."""
        refuse(self._metrics, self._rejections, self._log_source(source), reason, detail)

    def _start_loops(self, accept: Coroutine[Any, Any, None], plane: str) -> None:
        """Start ``accept`` and the sweep of the proven connections (tasks named after ``plane``)."""
        self._accept_task = asyncio.create_task(accept, name=f"{plane}-data-accept")
        self._sweeper_task = asyncio.create_task(self._sweep_proven(), name=f"{plane}-data-sweep")

    async def _stop_loops(self) -> None:
        """Stop accepting and sweeping."""
        for task in (self._accept_task, self._sweeper_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _sweep_proven(self) -> None:
        """End the proven connections whose session ended or that went silent."""
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            for conn, reason, message in list(self._proven.to_end(time.monotonic())):
                self._refuse(conn.source, reason, message)
                self._proven.leave(conn)
                self._end_proven(conn)

    def _evict(self, task: asyncio.Task[None], source: str, why: str) -> None:
        """A newcomer takes this unproven connection's place: counted, and its task ends it."""
        self._refuse(source, "too_many_connections", why)
        task.cancel()
