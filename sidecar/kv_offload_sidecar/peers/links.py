"""Outbound peer sessions: handshake, membership, data links on demand, location calls, back-off.

For every address discovery offers, one ``PeerLink`` task loops: handshake
(``POST /v1/handshake``, both steps) -> the peer is a *member* (``Location.member_joined``: it
owns its share of the directory; the session is key material, no socket is held) -> watch it:
its data connection is opened on demand by the engine path and closed when idle
(``data_links``: at most ``MAX_DATA_LINKS`` open); while one is open it is heartbeaten, and a
closed data connection or a silent heartbeat ends the link (the liveness rules and their
detection times are in ``liveness``); with or without one, a failure the engine path reports
(an exchange, a data open, a location call) ends it -> on any failure close, the peer leaves
the membership (``member_left``) and the link backs off exponentially with full jitter
(``backoff_delay``: a uniform draw below a cap that starts at ``backoff_initial_seconds`` and
doubles up to ``liveness.HEAL_BACKOFF_MAX_SECONDS`` for a lost or unreachable peer,
``backoff_max_seconds`` for a rejecting one, so the pool's pods do not all re-handshake a
restarted peer at the same instants; a handshake from that peer cuts the wait short, ``wake``),
except after a failure the engine path reports as not the peer's (this sidecar itself stalled,
``loop_stalls``): that link reconnects at once and its failure is not counted; a rejected
handshake backs off the same way (the peer may be fixed by a rollout) and shows as state
``rejected``. The other direction is the peer's own link to us (it dials us; inbound sessions
live in sessions.py), so each pair handshakes both ways.
``call`` sends one location message (``/v1/publish``, ``/v1/locate``) over a
connected link's session, with the HMAC of its session key, on the bounded HTTP client of
``control_client`` (its connections close when idle); a call that fails to a member with no
open data connection (none heartbeats it) reports it lost, and one heard nothing from is
probed (``liveness``).

Links are keyed by control address; the identity learnt in the handshake
de-duplicates several DP ports of one peer pod (only one link per identity is
connected; the others idle as aliases) and skips ourselves.
Everything here runs on the sidecar's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from kv_offload_sidecar.data.lanes import data_lanes_of
from kv_offload_sidecar.metrics import PEER_STATES
from kv_offload_sidecar.peers.handshake import (
    REASONS,
    HandshakeError,
    HandshakeInitiator,
    HelloMessage,
    Session,
)
from kv_offload_sidecar.peers.control_client import (  # noqa: F401 (AUTH_HEADER, SESSION_HEADER: theirs)
    AUTH_HEADER,
    LOCATION_OPS,
    MAX_LOCATION_REPLY_BYTES,
    SESSION_HEADER,
    SKIPPED_REQUEST_HEADERS,
    control_client,
    post_handshake_step,
)
from kv_offload_sidecar.peers.data_links import DATA_IDLE_SECONDS, MAX_DATA_LINKS, DataLinks
from kv_offload_sidecar.peers.directory.location_wire import LocateQuery, location_auth
from kv_offload_sidecar.peers.liveness import (
    HEARTBEAT_SECONDS,
    PROBE_TIMEOUT_SECONDS,
    RoundTrips,
    backoff_cap,
    backoff_delay,
    heartbeat,
    probe_period,
)
from kv_offload_sidecar.peers.pool_keys import PoolKeys
from kv_offload_sidecar.peers.sessions import REKEY_HEADER
from kv_offload_sidecar.waits import set_within
from kv_offload_sidecar.rejections import clip, loads_bounded

if TYPE_CHECKING:
    from kv_offload_sidecar.loop_stalls import LoopStalls
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.peers.discovery import Discovery
    from kv_offload_sidecar.peers.directory.location import Location
    from kv_offload_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

# The location call that probes a member heard nothing from (any key: an owner answers each).
PROBE_QUERY = LocateQuery((0,)).to_dict()


@dataclass
class PeerLink:
    """Our outbound relation with one peer control address."""

    # The peer's control address "host:port".
    address: str
    # connecting | connected | backoff | rejected | alias | self
    state: str = "connecting"
    # Peer identity from its hello (None before the first handshake).
    identity: str | None = None
    # Established session (outbound) while connected.
    session: Session | None = None
    # The peer's data-plane client while one is open (``data_links``: on demand).
    data: Any = None
    # Consecutive failures (drives back-off).
    failures: int = 0
    # Last failure or rejection, for /v1/peers.
    last_error: str = ""
    # monotonic time of the next attempt while backing off.
    retry_at: float = 0.0
    # Set by the engine path when the data plane failed: the link loop resets.
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    # The link's task.
    task: asyncio.Task[None] | None = None
    # Re-key the session (make before break) at the next watch interval.
    rekey: bool = False
    # True while the peer counts as a member of this sidecar's view (Location).
    member: bool = False
    # Set by a handshake from this peer: a link backing off retries now.
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # The last failure reported was not the peer's: reconnect without backing off.
    retry_now: bool = False
    # The peer's round trips, from the heartbeats (``liveness``).
    round_trips: RoundTrips = field(default_factory=RoundTrips)
    # The open of the data connection in progress (``data_links``), and whether it reached the
    # holder's host (``data.connect``'s ``reached``; ``liveness.last_heard``).
    opening: asyncio.Task[Any] | None = None
    open_reached: bool = False
    # Exchanges in flight on the data connection.
    busy: int = 0
    # monotonic time of the last exchange's start or end.
    used_at: float = 0.0
    # monotonic time of the last exchange or location call that did not fail (or the handshake).
    heard_at: float = 0.0
    # Set when the watch has something to do: a data connection opened, a failure, a re-key.
    stir: asyncio.Event = field(default_factory=asyncio.Event)

    def view(self) -> dict[str, Any]:
        return {
            "address": self.address, "identity": self.identity, "state": self.state,
            "failures": self.failures, "last_error": self.last_error,
            "data_address": self.session.peer.data_address if self.session else None,
            "key_id": self.session.key_id.hex() if self.session else None,
            "data_open": self.data is not None and self.state == "connected",
            "data_lanes": data_lanes_of(self.data) if self.state == "connected" else 0,
            "rtt_ms": round(self.round_trips.srtt * 1e3, 3) if self.round_trips.srtt is not None else None,
            "retry_in_seconds": max(0.0, round(self.retry_at - time.monotonic(), 3))
            if self.state in ("backoff", "rejected") else 0.0,
        }


class PeerManager:
    """Keeps one link per discovered address and exposes connected peers."""

    def __init__(self, settings: SidecarSettings, metrics: SidecarMetrics, discovery: Discovery,
                 location: Location, local_hello: Callable[[], HelloMessage], *,
                 keys: PoolKeys, data_options: Callable[[], dict[str, Any]] = dict,
                 stalls: LoopStalls | None = None, idle_seconds: float = DATA_IDLE_SECONDS,
                 max_data_links: int = MAX_DATA_LINKS) -> None:
        self._settings = settings
        self._keys = keys
        # This sidecar's own stalls: a failure across one is not the peer's.
        self._stalls = stalls
        self._metrics = metrics
        # The data-plane options of a new connection (the live TLS client context), read at each one.
        self._data_options = data_options
        # The data connections, opened on demand, closed when idle, bounded.
        self.data_links = DataLinks(settings, metrics, data_options=lambda: self._data_options(),
                                    on_failed=self._open_failed, idle_seconds=idle_seconds,
                                    max_open=max_data_links)
        self._discovery = discovery
        self._location = location
        self._local_hello = local_hello
        self._links: dict[str, PeerLink] = {}
        self._http: aiohttp.ClientSession | None = None
        self._closing = False

    # ---- queries ------------------------------------------------------------

    def links(self) -> list[PeerLink]:
        return list(self._links.values())

    def connected(self, identity: str) -> PeerLink | None:
        """The member link to ``identity`` (a session; its data connection opens on demand)."""
        for link in self._links.values():
            if link.identity == identity and link.state == "connected" and link.session is not None:
                return link
        return None

    def excused(self, started: float) -> bool:
        """A failure of something begun at loop time ``started`` is not the peer's (``loop_stalls``)."""
        return self._stalls is not None and self._stalls.excuse(started)

    def _open_failed(self, link: PeerLink, error: str, started: float) -> None:
        log.warning("peer %s (%s): %s", link.address, link.identity, error)
        self.report_failure(link, error, peer_at_fault=not self.excused(started))

    def data_view(self) -> dict[str, Any]:
        """For /v1/status: the lanes of each open data link (opened on demand, closed when idle:
        ``data_links``) and the links' counts and bound."""
        return {"data_lanes": {link.identity: data_lanes_of(link.data) for link in self._links.values()
                               if link.state == "connected" and link.identity and link.data is not None},
                "data_links": self.data_links.view()}

    def report_failure(self, link: PeerLink, error: str, *, peer_at_fault: bool = True) -> None:
        """The engine path saw an exchange with this peer fail: reset the link and back it off,
        or, when not ``peer_at_fault``, reconnect at once (also cutting short a back-off the
        link's own watch began when it saw the connection close first)."""
        link.last_error = error
        if link.state != "connected":  # its watch already saw the connection close
            if not peer_at_fault and link.state == "backoff":
                link.retry_now = True
                link.wake.set()
            return
        if not link.failed.is_set():
            link.retry_now = not peer_at_fault
        elif peer_at_fault:  # any failure the peer's own backs it off
            link.retry_now = False
        link.failed.set()
        link.stir.set()

    def answer_silence(self, identity: str, cap: float) -> float:
        """Seconds a request waits through without a frame from this peer (``liveness``)."""
        link = self.connected(identity)
        return cap if link is None else link.round_trips.answer_silence(cap)

    def wake(self, address: str) -> None:
        """The peer at ``address`` just handshook with us: a link backing off retries now."""
        link = self._links.get(address)
        if link is not None and link.state in ("backoff", "rejected"):
            link.wake.set()

    async def call(self, identity: str, op: str, body: dict[str, Any], timeout: float, *,
                   close: bool = False) -> Any:
        """One location message to a connected peer; its JSON reply (with ``close``, a probe's, on a
        connection closed after it: a probe keeps none warm). ConnectionError, asyncio.TimeoutError
        or ValueError (a reply too large or not JSON) when it cannot be had (the caller decides
        whether the peer failed); any other error of aiohttp's is counted as ``malformed`` and
        raised as ConnectionError, so no answer of a peer escapes as a traceback."""
        link = self.connected(identity)
        if link is None or link.session is None or self._http is None or op not in LOCATION_OPS:
            raise ConnectionError(f"peer {identity} is not connected")
        session = link.session
        started = asyncio.get_running_loop().time()
        raw = json.dumps(body, separators=(",", ":")).encode()
        headers = {SESSION_HEADER: session.session_id.hex(), AUTH_HEADER: location_auth(session.session_key, op, raw),
                   "Content-Type": "application/json", **({"Connection": "close"} if close else {})}
        try:
            async with self._http.post(f"http://{link.address}/v1/{op}", data=raw, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.headers.get(REKEY_HEADER) and session.key_id != self._keys.offered_ids()[0]:
                    link.rekey = True  # the peer moved on to a key we hold too
                    link.stir.set()
                reply = await resp.content.read(MAX_LOCATION_REPLY_BYTES + 1)
                if resp.status != 200:
                    raise ConnectionError(f"{op} to {identity}: HTTP {resp.status}")
        except aiohttp.ClientError as exc:
            self._call_failed(link, f"{op}: {exc}", started)
            raise ConnectionError(f"{op} to {identity} failed: {exc}") from exc
        except (OSError, asyncio.TimeoutError) as exc:  # our ConnectionError above, a timeout
            self._call_failed(link, f"{op}: {type(exc).__name__}: {exc}", started)
            raise
        except Exception as exc:  # aiohttp tripped over what the peer sent: that peer failed
            self._metrics.protocol_errors.labels(reason="malformed").inc()
            raise ConnectionError(f"{op} to {identity} failed: {type(exc).__name__}: {clip(str(exc))}") from exc
        if len(reply) > MAX_LOCATION_REPLY_BYTES:
            raise ValueError(f"{op} reply from {identity} exceeds {MAX_LOCATION_REPLY_BYTES} bytes")
        link.heard_at = time.monotonic()
        # A round-trip sample where no heartbeat gives one (``liveness``: the answer silence).
        if link.data is None:
            link.round_trips.observe(asyncio.get_running_loop().time() - started)
        self._metrics.location_messages.labels(kind=op).inc()
        self._metrics.location_bytes.labels(direction="sent").inc(len(raw))
        self._metrics.location_bytes.labels(direction="received").inc(len(reply))
        return loads_bounded(reply)

    def _call_failed(self, link: PeerLink, error: str, started: float) -> None:
        """A location call failed: a member with no open data connection (no heartbeat judges
        it) is reported lost; one with a data connection is left to its heartbeats."""
        if link.data is None and link.opening is None and link.state == "connected":
            self.report_failure(link, error, peer_at_fault=not self.excused(started))

    # ---- lifecycle ------------------------------------------------------------

    async def run(self) -> None:
        """Follow discovery forever (cleanup_ctx task)."""
        self._http = control_client(self._settings.peers.handshake_timeout_seconds)
        try:
            while True:
                self._discovery.forget_unreachable(self._links.values())
                self._sync(self._discovery.current())
                await self._discovery.wait_changed(1.0)
        finally:
            await self.close()

    async def close(self) -> None:
        self._closing = True
        tasks = [link.task for link in self._links.values() if link.task]
        for link in self._links.values():
            link.wake.set()  # a back-off ends now
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for link in self._links.values():
            await self._teardown(link)
        await self.data_links.aclose()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _sync(self, wanted: set[str]) -> None:
        for addr in wanted - set(self._links):
            link = PeerLink(addr)
            self._links[addr] = link
            link.task = asyncio.create_task(self._link_loop(link), name=f"peer {addr}")
        for addr in set(self._links) - wanted:
            link = self._links.pop(addr)
            if link.task:
                link.task.cancel()
            self._leave(link)
            log.info("peer %s (%s) left discovery", addr, link.identity)
        self._update_gauge()

    def _update_gauge(self) -> None:
        # "alias" and "self" links (another DP port of a connected peer, or ourselves) are
        # not counted.
        counts = dict.fromkeys(PEER_STATES, 0)
        for link in self._links.values():
            if link.state in counts:
                counts[link.state] += 1
        for state, n in counts.items():
            self._metrics.peers.labels(state=state).set(n)

    def _set_state(self, link: PeerLink, state: str) -> None:
        link.state = state
        self._update_gauge()

    # ---- one link --------------------------------------------------------------

    async def _link_loop(self, link: PeerLink) -> None:
        s = self._settings
        try:
            while not self._closing:  # also ends a loop whose cancellation got lost
                self._set_state(link, "connecting")
                try:
                    await self._connect(link)
                except HandshakeError as exc:
                    if exc.reason == "self":
                        self._set_state(link, "self")
                        return
                    if exc.reason == "alias":
                        self._set_state(link, "alias")
                        await asyncio.sleep(s.peers.dns_interval_seconds)
                        continue
                    link.last_error = str(exc)
                    await self._back_off(link, "rejected")
                    continue
                except Exception as exc:  # network, timeout, transport: back off
                    link.last_error = f"{type(exc).__name__}: {exc}"
                    log.info("peer %s unreachable: %s", link.address, link.last_error)
                    await self._teardown(link)
                    await self._back_off(link, "backoff")
                    continue
                link.failures = 0
                link.heard_at = time.monotonic()
                link.last_error = ""
                link.failed.clear()  # a late report about the connection before is not this one's
                self._set_state(link, "connected")
                log.info("peer %s (%s) connected", link.address, link.identity)
                link.member = True
                self._location.member_joined(link.identity)  # type: ignore[arg-type]
                try:
                    await self._watch(link)
                except Exception as exc:
                    link.last_error = link.last_error or f"{type(exc).__name__}: {exc}"
                log.info("peer %s (%s) lost: %s", link.address, link.identity, link.last_error)
                await self._teardown(link)
                await self._back_off(link, "backoff")
        except asyncio.CancelledError:
            await self._teardown(link)
            raise

    async def _back_off(self, link: PeerLink, state: str) -> None:
        if link.retry_now:  # not the peer's failure: no wait, nothing counted
            link.retry_now = False
            return
        s = self._settings.peers
        link.failures += 1
        delay = backoff_delay(link.failures, s.backoff_initial_seconds, backoff_cap(state, s.backoff_max_seconds))
        link.retry_at = time.monotonic() + delay
        self._set_state(link, state)
        link.wake.clear()
        if not self._closing:
            await set_within(link.wake, delay)
        if link.retry_now:  # the wait was cut short for that reason
            link.failures -= 1
            link.retry_now = False

    def _leave(self, link: PeerLink) -> None:
        if link.member and link.identity:
            link.member = False
            self._location.member_left(link.identity)

    async def _teardown(self, link: PeerLink) -> None:
        link.session = None
        self._leave(link)
        link.failed.clear()
        await self.data_links.close_now(link)

    async def _establish(self, link: PeerLink) -> tuple[HelloMessage, Session]:
        """Handshake with the peer at ``link.address`` (its data connection opens on demand)."""
        s = self._settings
        initiator = HandshakeInitiator(self._keys, self._local_hello())
        url = f"http://{link.address}/v1/handshake"
        step2 = initiator.step2(await self._post(url, initiator.step1()))
        try:
            remote, session = initiator.finish(await self._post(url, step2))
        except HandshakeError as exc:
            self._count_rejection(exc, link.address)
            raise
        if remote.identity == s.network.identity:
            raise HandshakeError("self", "this address is ourselves")
        other = self.connected(remote.identity)
        if other is not None and other is not link:
            link.identity = remote.identity
            raise HandshakeError("alias", f"{remote.identity} already connected via {other.address}")
        self.data_links.check_dialable(remote.data_address)  # a TLS pod and a plain one: no members
        self._metrics.handshakes.labels(result="accepted", reason="ok").inc()
        return remote, session

    async def _connect(self, link: PeerLink) -> None:
        remote, link.session = await self._establish(link)
        link.identity = remote.identity

    async def _rekey(self, link: PeerLink) -> None:
        """Make before break: a new session with the current key (and a new data connection
        where one is open), then the old one closes."""
        link.rekey = False
        try:
            remote, session = await self._establish(link)
            data = await self.data_links.connect(session) if link.data is not None else None
        except Exception as exc:
            log.info("peer %s (%s): re-key failed (%s); keeping the current session",
                     link.address, link.identity, exc)
            return
        if link.data is None and data is not None:  # closed as idle meanwhile
            self.data_links.retire(data, 0.0)
            data = None
        old = link.data if data is not None else None  # one opened meanwhile runs on to its key's end
        link.session = session
        if data is not None:
            link.data = data
        log.info("peer %s (%s): re-keyed with pool key %s", link.address, remote.identity,
                 session.key_id.hex())
        if old is not None:  # requests still running on it finish first (they have a deadline)
            self.data_links.retire(old, self._settings.peers.fetch_deadline_seconds + 1.0)

    def keys_changed(self) -> int:
        """This sidecar's keys changed: links not on the current key re-key; returns how many."""
        current = self._keys.offered_ids()[0]
        n = 0
        for link in self._links.values():
            if link.session is not None and link.session.key_id != current:
                link.rekey = True
                link.stir.set()
                n += 1
        return n

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        """One handshake step (``control_client.post_handshake_step``)."""
        assert self._http is not None
        return await post_handshake_step(self._http, url, body, self._count_rejection)

    def _count_rejection(self, exc: HandshakeError, where: str) -> None:
        reason = exc.reason if exc.reason in REASONS else "malformed"
        self._metrics.handshakes.labels(result="rejected", reason=reason).inc()
        log.warning("handshake with %s rejected (%s): %s%s", where, reason, exc,
                    "".join(f"\n  {line}" for line in exc.diff))

    async def _watch(self, link: PeerLink) -> None:
        """While connected: re-key when asked; end when the engine path reported a failure.
        While a data connection is open: a heartbeat every ``HEARTBEAT_SECONDS`` (``liveness``),
        end when it closed or went silent, close it (the link stays) once idle (``data_links``).
        With none open, wait for something to do (``PeerLink.stir``), and probe the member with
        a location call when nothing was heard from it for ``liveness.probe_period``."""
        while True:
            link.stir.clear()
            if link.failed.is_set():
                raise ConnectionError(link.last_error or "data plane failed")
            if link.rekey:
                await self._rekey(link)
            data = link.data
            if data is None:
                quiet, period = time.monotonic() - link.heard_at, probe_period(len(self._links) - 1)
                if quiet < period:
                    await set_within(link.stir, period - quiet)
                elif link.opening is None and link.identity is not None:
                    link.heard_at = time.monotonic()  # the next probe comes a period later, whatever this one does
                    with contextlib.suppress(Exception):  # a failure reports the link (``call``)
                        await self.call(link.identity, "locate", PROBE_QUERY, PROBE_TIMEOUT_SECONDS, close=True)
                continue
            if data.closed:
                raise ConnectionError(link.last_error or "data connection closed")
            if self.data_links.is_idle(link):
                log.info("peer %s (%s): data link idle, closed", link.address, link.identity)
                self.data_links.close(link)
                continue
            try:
                await heartbeat(data, link.round_trips)
            except Exception as exc:
                if link.data is not data:  # closed here meanwhile (idle, or for another link)
                    continue
                link.last_error = link.last_error or f"liveness: {exc}"
                raise
            if await set_within(link.failed, HEARTBEAT_SECONDS):
                raise ConnectionError(link.last_error or "data plane failed")
