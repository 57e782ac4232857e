"""EngineClient: the engine side of the pod's sidecar (runs inside vLLM).

Standard library only. Blocking sockets with timeouts, thread-safe (a pool
of local-channel connections, one per concurrent call). The client asks the
sidecar's control port once (``GET /v1/local``) where the local channel
socket and the shared-memory store file are, maps the store file with
``ChunkStoreView`` and from then on moves chunk bytes without sockets:

- ``lookup(keys, timeout) -> LookupReply(local, peer, known_at)``: hit prefix lengths,
  and when the sidecar knew them (its ``time.monotonic()``; one clock in a pod).
  ``lookup_start`` sends it and returns a ``PendingLookup`` whose answer any
  thread can read later without blocking (``pending_lookup``).
- ``store(keys, write_fn) -> int``: the sidecar reserves slots,
  ``write_fn(i, slot_view)`` copies chunk ``i`` into its slot, the sidecar
  commits (checksums) them; returns the number of chunks written. Keys the
  sidecar already holds (or has no room for) are skipped.
- ``load(keys, read_fn, timeout) -> int``: the sidecar makes the leading keys
  local (fetching from peers into its slots) and pins them; ``read_fn(i,
  slot_view)`` copies chunk ``i`` out; the pins are released; returns the
  number of leading chunks read.

With ``region`` (the file behind vLLM's primary region, ``region_file``), each
attachment also hands that file to the sidecar (``attach_region``, on a
connection kept open for the attachment's life) and then
``store_rows(keys, rows)`` / ``load_rows(keys, rows, timeout)`` name rows
instead of copying: the sidecar copies, and vLLM's process moves no KV bytes.
``region_attached`` says whether that worked (``region_reason`` why not).
``load``/``load_rows``/``store_rows`` may name a ``job`` (an id the caller chooses);
``cancel(jobs)`` makes the sidecar stop those at once (no fetch awaited, no copy piece
started): the call then returns what was whole by then, and its return means the sidecar
touches none of its rows any more (a strict store cut short raises ``StoreCut``).

A sidecar that goes away is noticed when the connection held to it ends (its store is unmapped
then, freeing /dev/shm: ``sidecar_attachment``) or at a failed call; the client re-attaches (region
too) at a call ``REATTACH_INTERVAL_SECONDS`` or more later once a new sidecar answers, logs how
long that took (``reattach_seconds``); until then stores fail (none is reported done).

A late answer (past ``timeout``), a failed or unreachable sidecar is a miss
(``LookupReply(0, 0)`` / 0) and counted in ``timeouts`` / ``errors``; it
never raises into the engine. Exceptions from ``write_fn``/``read_fn``
propagate after the reservation/pin is given back.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.engine.pending_lookup import MISS, LookupReply, PendingLookup
from kv_offload_sidecar.engine.sidecar_attachment import Attachment, Late, LocalConn, RowRegion

log = logging.getLogger(__name__)

# Extra seconds the client waits beyond an operation's timeout for the answer
# to travel back over the local socket.
REPLY_GRACE_SECONDS = 0.5
# Timeout of the bookkeeping requests of store (reserve/commit) and release.
CONTROL_TIMEOUT_SECONDS = 5.0
# Seconds past a row job's deadline the client still waits for the sidecar's answer: the
# sidecar reads or writes no row after the deadline but the piece in flight (at most 32 MiB).
ROW_COPY_GRACE_SECONDS = 2.0
# Shortest pause between attempts to re-attach to a restarted sidecar.
REATTACH_INTERVAL_SECONDS = 0.5

WriteFn = Callable[[int, memoryview], None]
ReadFn = Callable[[int, memoryview], None]


class SidecarUnavailable(ConnectionError):
    """The sidecar's control port or local channel cannot be reached."""


class StoreCut(Exception):
    """A strict ``store_rows`` whose reserved chunks did not all land (deadline or cancel)."""

    def __init__(self, message: str, committed: int) -> None:
        super().__init__(message)
        self.committed = committed  # the chunks of it that did land


class _Dropped(Exception):
    """The channel broke after the work was done (the connection must not be reused)."""


# What turns a call into a miss (never raised into the engine).
_FAILURES = (Late, OSError, ValueError, KeyError, TypeError)


class EngineClient:
    """Blocking, thread-safe client of one DP rank's sidecar.

    Every request that hands out slots names the sidecar instance whose store
    file this client mapped; a restarted sidecar (new instance, new file at the
    same path) refuses it, and the client re-attaches (at most every
    ``REATTACH_INTERVAL_SECONDS``) instead of writing into the old mapping.
    """

    def __init__(self, socket_path: str, *, timeout: float = 5.0,
                 region: RowRegion | None = None, states: Mapping[str, Any] | None = None) -> None:
        self.socket_path = socket_path
        # What the engine states with every ``info`` (``ModelIdentity.statement``: its identity).
        self.states = dict(states or {})
        self._timeout = timeout
        self._region = region
        self._idle: list[LocalConn] = []
        self._lock = threading.Lock()
        self._closed = False
        self._stale = False
        # When the client first failed against a sidecar it had attached (None: attached now).
        self._stale_since: float | None = None
        # Seconds from that failure to the re-attachment, of the last re-attachment (None: none yet).
        self.reattach_seconds: float | None = None
        self._next_reattach = 0.0
        # Answers that came too late (counted as misses).
        self.timeouts = 0
        # Failed calls (sidecar gone, bad reply), counted as misses.
        self.errors = 0
        # Times the client re-mapped the store of a restarted sidecar.
        self.reattaches = 0
        self._att = self._attach(self._info())

    # ---- construction ---------------------------------------------------------

    @classmethod
    def connect(cls, host: str = ports.DEFAULT_HOST, port: int = ports.DEFAULT_BASE_PORT,
                timeout: float = 5.0, region: RowRegion | None = None,
                states: Mapping[str, Any] | None = None) -> "EngineClient":
        """Ask the sidecar control port ``host:port`` (one DP rank's port) for its local channel."""
        try:
            http_conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                http_conn.request("GET", "/v1/local")
                resp = http_conn.getresponse()
                body = resp.read(1 << 20)
            finally:
                http_conn.close()
        except (OSError, http.client.HTTPException) as exc:
            raise SidecarUnavailable(
                f"cannot reach the kv-offload sidecar at {host}:{port} ({exc}); check "
                f"VLLM_P2P_SIDE_CHANNEL_HOST/PORT and that the sidecar container runs") from None
        try:
            info = json.loads(body)
        except ValueError:
            info = None
        if resp.status != 200 or not isinstance(info, dict) or not isinstance(info.get("socket"), str):
            raise SidecarUnavailable(f"sidecar at {host}:{port} answered /v1/local with HTTP {resp.status}: "
                                     f"{body[:200]!r}")
        return cls(info["socket"], timeout=timeout, region=region, states=states)

    @classmethod
    def from_env(cls, dp_index: int = 0, timeout: float = 5.0,
                 environ: Mapping[str, str] | None = None) -> "EngineClient":
        """Connect to ``VLLM_P2P_SIDE_CHANNEL_HOST``:(``VLLM_P2P_SIDE_CHANNEL_PORT`` + global DP index)."""
        env = os.environ if environ is None else environ
        return cls.connect(ports.env_host(env), ports.control_port(ports.env_base_port(env), dp_index),
                           timeout)

    # ---- geometry -----------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk slot (the pool's kv_bytes_per_chunk)."""
        return self._att.view.slot_bytes

    @property
    def num_slots(self) -> int:
        return self._att.view.num_slots

    @property
    def instance(self) -> str:
        """The sidecar instance whose store this client maps."""
        return self._att.instance

    @property
    def attached_now(self) -> bool:
        """Whether a call now would use the current attachment as it is (no re-attachment
        first, which may block): the sidecar has not seemed to restart."""
        return not self._stale and not self._closed

    @property
    def region_attached(self) -> bool:
        """Whether the sidecar maps vLLM's rows (``store_rows``/``load_rows`` work)."""
        return self._att.region_id is not None

    @property
    def region_reason(self) -> str:
        """Why the region is not attached ("" when it is)."""
        return self._att.region_reason

    # ---- connections -------------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        with self._connection() as conn:
            reply = conn.call({"op": "info", **self.states}, self._timeout)
        if not reply.get("ok") or not isinstance(reply.get("store"), dict) or "instance" not in reply:
            raise SidecarUnavailable(f"sidecar local channel {self.socket_path!r} refused info: "
                                     f"{reply.get('error')}")
        return reply

    def _mark_stale(self) -> None:
        if not self._stale:
            self._stale, self._stale_since = True, time.monotonic()

    def _attachment(self) -> Attachment:
        """The current mapping; re-attaches first when the sidecar seems to have restarted."""
        if self._stale and time.monotonic() >= self._next_reattach:
            with self._lock:  # pooled connections may lead to the sidecar that went
                self._next_reattach = time.monotonic() + REATTACH_INTERVAL_SECONDS
                idle, self._idle = self._idle, []
            for conn in idle:
                conn.close()
            try:
                info = self._info()
                if str(info["instance"]) != self._att.instance or self._att.region_lost or self._att.gone:
                    old, self._att = self._att, self._attach(info)
                    self.reattaches += 1
                    old.close()
                    self.reattach_seconds = time.monotonic() - (self._stale_since or time.monotonic())
                    log.info("kv-offload sidecar restarted; re-attached its store %s %.2f s after "
                             "it was found gone (tried at most every %.1f s, at the next call)",
                             info["store"]["path"], self.reattach_seconds, REATTACH_INTERVAL_SECONDS)
                self._stale, self._stale_since = False, None
            except _FAILURES as exc:
                log.debug("kv-offload sidecar re-attach failed: %s", exc)
        return self._att

    def _attach(self, info: Mapping[str, Any]) -> Attachment:
        return Attachment(info, self.socket_path, self._region, self._timeout, self._mark_stale)

    @contextmanager
    def _connection(self) -> Iterator[LocalConn]:
        conn = self._checkout()
        ok = False
        try:
            yield conn
            ok = True
        finally:
            self._checkin(conn, ok)

    def _checkout(self) -> LocalConn:
        """A pooled connection, or a new one."""
        with self._lock:
            if self._closed:
                raise SidecarUnavailable("EngineClient is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            try:
                conn = LocalConn(self.socket_path, self._timeout)
            except OSError as exc:
                self._mark_stale()
                raise SidecarUnavailable(f"cannot connect to the sidecar local channel "
                                         f"{self.socket_path!r}: {exc}") from None
        return conn

    def _checkin(self, conn: LocalConn, ok: bool) -> None:
        """Back to the pool after a whole exchange; closed otherwise (state unknown)."""
        if ok:
            with self._lock:
                if not self._closed:
                    self._idle.append(conn)
                    return
        conn.close()

    def _call(self, conn: LocalConn, att: Attachment, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request naming ``att``'s instance; a refused reply raises ConnectionError."""
        reply = conn.call({**req, "instance": att.instance}, timeout)
        if not reply.get("ok"):
            if reply.get("stale"):
                self._mark_stale()
                if "region" in req:
                    att.region_lost = True
            raise ConnectionError(str(reply.get("error")))
        return reply

    def _miss(self, what: str, exc: BaseException) -> None:
        if isinstance(exc, Late):
            self.timeouts += 1
            log.debug("kv-offload sidecar %s answered late: a miss", what)
        else:
            self.errors += 1
            if isinstance(exc, OSError):
                self._mark_stale()  # the sidecar may have restarted: re-attach on the next call
            log.warning("kv-offload sidecar %s failed (%s): a miss", what, exc)

    # ---- operations ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """The sidecar's local info (identity, fingerprint, instance, store geometry)."""
        return self._info()

    def lookup(self, keys: Sequence[bytes], timeout: float = 2.0) -> LookupReply:
        """Hit prefix of ``keys`` (local, then on a peer). Late or failed: (0, 0)."""
        return self.lookup_start(keys, timeout).wait()

    def lookup_start(self, keys: Sequence[bytes], timeout: float = 2.0, *,
                     reattach: bool = True) -> PendingLookup:
        """Send a lookup of ``keys`` and return at once; its ``poll()`` reads the answer
        without blocking, on any thread (``pending_lookup``). Late or failed: (0, 0).
        Without ``reattach`` it never re-attaches first (a restarted sidecar refuses it)."""
        if not keys:
            return PendingLookup.answered(MISS)
        try:
            att = self._attachment() if reattach else self._att
            conn = self._checkout()
        except _FAILURES as exc:
            self._miss("lookup", exc)
            return PendingLookup.answered(MISS)
        try:
            conn.send({"op": "lookup", "keys": cp.encode_keys(keys), "timeout": timeout,
                       "instance": att.instance}, self._timeout)
        except _FAILURES as exc:
            conn.close()
            self._miss("lookup", exc)
            return PendingLookup.answered(MISS)
        return PendingLookup(conn, time.monotonic() + timeout + REPLY_GRACE_SECONDS,
                             self._lookup_answered)

    def _lookup_answered(self, conn: LocalConn, answer: dict[str, Any] | BaseException) -> LookupReply:
        """A lookup's end: its connection back to the pool and its reply, or a counted miss."""
        try:
            if isinstance(answer, BaseException):
                raise answer
            if not answer.get("ok"):
                if answer.get("stale"):
                    self._mark_stale()
                raise ConnectionError(str(answer.get("error")))
            known = answer.get("known_at")
            reply = LookupReply(int(answer["local"]), int(answer["peer"]),
                                float(known) if isinstance(known, (int, float))
                                and not isinstance(known, bool) else None)
        except _FAILURES as exc:
            self._checkin(conn, False)
            self._miss("lookup", exc)
            return MISS
        self._checkin(conn, True)
        return reply

    def store(self, keys: Sequence[bytes], write_fn: WriteFn, *, strict: bool = False) -> int:
        """Write chunks into the sidecar's store; returns how many were written.

        ``write_fn(i, view)`` must fill ``view`` (exactly ``slot_bytes``) with
        chunk ``keys[i]``; it is not called for keys that are skipped (held
        already, being written, or no free slot). A failed store is counted
        and returns 0, or with ``strict`` raises ``SidecarUnavailable``, so a
        caller can tell it from keys that were all skipped.
        """
        if not keys:
            return 0
        user_exc: BaseException | None = None
        written = 0
        try:
            att = self._attachment()
            with self._connection() as conn:
                reply = self._call(conn, att, {"op": "reserve", "keys": cp.encode_keys(keys)},
                                   CONTROL_TIMEOUT_SECONDS)
                rid = reply["id"]
                user_exc = att.each_slot(reply["slots"], write_fn)  # raised once given back
                if user_exc is not None:
                    self._call(conn, att, {"op": "abort", "id": rid}, CONTROL_TIMEOUT_SECONDS)
                else:
                    reply = self._call(conn, att, {"op": "commit", "id": rid}, CONTROL_TIMEOUT_SECONDS)
                    written = int(reply["committed"])
        except _FAILURES as exc:
            self._miss("store", exc)
            if strict and user_exc is None:
                raise SidecarUnavailable(f"store of {len(keys)} chunks failed: {exc}") from None
            written = 0
        if user_exc is not None:
            raise user_exc
        return written

    def load(self, keys: Sequence[bytes], read_fn: ReadFn, timeout: float = 2.0, *,
             job: str | None = None) -> int:
        """Read the leading held chunks of ``keys``; returns how many were read.

        ``read_fn(i, view)`` copies chunk ``keys[i]`` out of ``view`` (valid
        only during the call). Late or failed: 0. ``job``: an id ``cancel`` can name.
        """
        if not keys:
            return 0
        user_exc: BaseException | None = None
        read = 0
        try:
            att = self._attachment()
            with self._connection() as conn:
                req = {"op": "load", "keys": cp.encode_keys(keys), "timeout": timeout}
                if job is not None:
                    req["job"] = job
                reply = self._call(conn, att, req, timeout + REPLY_GRACE_SECONDS)
                pid, slots = reply["id"], reply["slots"]
                user_exc = att.each_slot(slots, read_fn)  # raised once released
                read = len(slots) if user_exc is None else 0
                if slots:
                    try:
                        self._call(conn, att, {"op": "release", "id": pid}, CONTROL_TIMEOUT_SECONDS)
                    except _FAILURES as exc:
                        # The copies were made while pinned; a lost channel releases the pins.
                        log.debug("kv-offload release after load failed: %s", exc)
                        raise _Dropped() from exc
        except _Dropped:
            pass  # read stays what was copied
        except _FAILURES as exc:
            self._miss("load", exc)
            read = 0
        if user_exc is not None:
            raise user_exc
        return read

    def store_rows(self, keys: Sequence[bytes], rows: Sequence[int], *, strict: bool = False,
                   paced: bool = False, job: str | None = None) -> int:
        """The sidecar copies ``rows`` (vLLM's) into its store; returns how many it committed.

        Keys the sidecar holds already or has no room for are skipped. A failed store is
        counted and returns 0, or with ``strict`` raises ``SidecarUnavailable`` (``StoreCut``
        when reserved chunks did not land by its deadline or a ``cancel`` of ``job``).
        ``paced``: the sidecar spreads the copies over the first half of the deadline.
        """
        reply = self._row_job("store_rows", "committed", keys, rows, CONTROL_TIMEOUT_SECONDS,
                              strict=strict, job=job, extra={"paced": True} if paced else None)
        if strict and reply.get("cut", 0) > 0:
            raise StoreCut(f"{reply['cut']} of {len(keys)} chunks did not land by the job's "
                           f"deadline or its cancel", reply["committed"])
        return reply.get("committed", 0)

    def load_rows(self, keys: Sequence[bytes], rows: Sequence[int], timeout: float = 2.0, *,
                  job: str | None = None) -> int:
        """The sidecar makes the leading held ``keys`` local and copies them into ``rows``;
        returns how many leading rows now hold their chunk. Late or failed: 0. ``job``: an
        id ``cancel`` can name."""
        return self.load_rows_held(keys, rows, timeout, job=job, hold_late=False)[0]

    def load_rows_held(self, keys: Sequence[bytes], rows: Sequence[int], timeout: float = 2.0,
                       *, job: str | None = None, hold_late: bool = True) -> tuple[int, Any]:
        """``load_rows``, and the connection of a sidecar that has not answered by then (else
        None; closed unless ``hold_late``): its job may write ``rows`` until its answer, or
        the connection's end, arrives there. The caller owns (closes) it."""
        held: list[LocalConn] = []
        reply = self._row_job("load_rows", "loaded", keys, rows, timeout, strict=False, job=job,
                              held=held if hold_late else None)
        return reply.get("loaded", 0), (held[0] if held else None)

    def cancel(self, jobs: Sequence[str]) -> int:
        """Make the sidecar stop the calls named ``jobs`` (``load``, ``load_rows``, ``store_rows``)
        now, also one whose request it has not read yet; how many were running (0 on failure or no
        answer within ``REPLY_GRACE_SECONDS``: a sidecar that does not answer at once is
        stalled, and the calls end at their deadlines)."""
        if not jobs:
            return 0
        try:  # no re-attachment first: the jobs run where they were sent
            with self._connection() as conn:
                reply = conn.call({"op": "cancel", "jobs": list(jobs)}, REPLY_GRACE_SECONDS)
            if not reply.get("ok"):
                raise ConnectionError(str(reply.get("error")))
            return int(reply["cancelled"])
        except _FAILURES as exc:
            self._miss("cancel", exc)
            return 0

    def _row_job(self, op: str, answer: str, keys: Sequence[bytes], rows: Sequence[int],
                 timeout: float, *, strict: bool, job: str | None = None,
                 extra: dict[str, Any] | None = None, held: list | None = None) -> dict[str, int]:
        """One store_rows/load_rows request: the sidecar touches no row after ``timeout``
        (its deadline), and the answer is awaited ``ROW_COPY_GRACE_SECONDS`` longer: its
        counts, ``answer`` among them ({} when it failed and not ``strict``). ``held``
        takes a connection whose answer is still due, instead of closing it."""
        if not keys:
            return {}
        what = op.removesuffix("_rows")
        try:
            att = self._attachment()
            if att.region_id is None:
                raise SidecarUnavailable(f"region not attached: {att.region_reason}")
            deadline = time.monotonic() + timeout
            req = {"op": op, "region": att.region_id, "keys": cp.encode_keys(keys),
                   "rows": [int(r) for r in rows], "deadline": deadline}
            if job is not None:
                req["job"] = job
            req.update(extra or {})
            conn, ok = self._checkout(), False
            try:
                reply = self._call(conn, att, req, timeout + ROW_COPY_GRACE_SECONDS)
                ok = True
            except Late:
                if held is not None:  # the answer is still due on it: the caller's now
                    held.append(conn)
                raise
            finally:
                if conn not in (held or ()):
                    self._checkin(conn, ok)
            return {k: int(reply[k]) for k in (answer, "cut") if k == answer or k in reply}
        except (*_FAILURES, SidecarUnavailable) as exc:
            self._miss(what, exc)
            if strict:
                raise SidecarUnavailable(f"{what} of {len(keys)} chunks failed: {exc}") from None
            return {}

    def close(self) -> None:
        """Close connections and unmap the store (the sidecar keeps its file)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        self._att.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
