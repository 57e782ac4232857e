"""Outbound peer sessions: handshake, data-plane client, summary pulls, back-off.

For every address discovery offers, one ``PeerLink`` task loops:
handshake (``POST /v1/handshake``, both steps) -> data-plane connect with
the session -> pull key summaries every interval -> on any failure close,
forget the peer's summary and back off exponentially (``backoff_initial``
doubling to ``backoff_max``); a rejected handshake backs off the same way
(the peer may be fixed by a rollout) and shows as state ``rejected``.
The other direction is the peer's own link to us (it dials us; inbound
sessions live in service.py), so each pair handshakes both ways.

Links are keyed by control address; the identity learnt in the handshake
de-duplicates several DP ports of one peer pod (only one link per identity is
connected; the others idle as aliases) and skips ourselves.
Everything here runs on the sidecar's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from kv_offload_sidecar.peers.handshake import (
    REASONS,
    HandshakeError,
    HandshakeInitiator,
    HelloMessage,
    Session,
)
from kv_offload_sidecar.peers.location import PeerSummaries, SummaryDelta
from kv_offload_sidecar.peers.pool_keys import PoolKeys
from kv_offload_sidecar.peers.sessions import REKEY_HEADER

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics
    from kv_offload_sidecar.peers.discovery import Discovery
    from kv_offload_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

SESSION_HEADER = "X-KV-Offload-Session"
AUTH_HEADER = "X-KV-Offload-Auth"
# States counted in the peers{state} gauge (metrics.PEER_STATES); "alias" and "self"
# links (another DP port of a connected peer, or ourselves) are not counted.
PEER_STATES = ("connecting", "connected", "backoff", "rejected")
# Largest summary reply read from a peer (bytes): 1M digests in base64 plus slack.
MAX_SUMMARY_REPLY_BYTES = 12 << 20


def summary_auth(session_key: bytes, epoch: str, since: int) -> str:
    """HMAC proving a summary pull belongs to an authenticated session."""
    msg = f"summary\x00{epoch}\x00{since}".encode()
    return hmac.new(session_key, msg, hashlib.sha256).hexdigest()


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
    # The peer's data-plane client while connected.
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
    # Re-key the session (make before break) at the next summary interval.
    rekey: bool = False

    def view(self) -> dict[str, Any]:
        return {
            "address": self.address, "identity": self.identity, "state": self.state,
            "failures": self.failures, "last_error": self.last_error,
            "data_address": self.session.peer.data_address if self.session else None,
            "key_id": self.session.key_id.hex() if self.session else None,
            "retry_in_seconds": max(0.0, round(self.retry_at - time.monotonic(), 3))
            if self.state in ("backoff", "rejected") else 0.0,
        }


class PeerManager:
    """Keeps one link per discovered address and exposes connected peers."""

    def __init__(self, settings: SidecarSettings, metrics: SidecarMetrics, discovery: Discovery,
                 summaries: PeerSummaries, local_hello: Callable[[], HelloMessage], *,
                 keys: PoolKeys, data_options: dict[str, Any] | None = None) -> None:
        self._settings = settings
        self._keys = keys
        self._data_options = dict(data_options or {})
        self._metrics = metrics
        self._discovery = discovery
        self._summaries = summaries
        self._local_hello = local_hello
        self._links: dict[str, PeerLink] = {}
        # Data clients replaced by a re-key, closed once their last request is over.
        self._retiring: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._closing = False

    # ---- queries ------------------------------------------------------------

    def links(self) -> list[PeerLink]:
        return list(self._links.values())

    def connected(self, identity: str) -> PeerLink | None:
        for link in self._links.values():
            if link.identity == identity and link.state == "connected" and link.data is not None:
                return link
        return None

    def report_failure(self, link: PeerLink, error: str) -> None:
        """The engine path saw this peer fail: reset and back it off."""
        link.last_error = error
        link.failed.set()

    # ---- lifecycle ------------------------------------------------------------

    async def run(self) -> None:
        """Follow discovery forever (cleanup_ctx task)."""
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._settings.handshake_timeout_seconds),
            trust_env=False)
        try:
            while True:
                self._sync(self._discovery.current())
                await self._discovery.wait_changed(1.0)
        finally:
            await self.close()

    async def close(self) -> None:
        self._closing = True
        tasks = [link.task for link in self._links.values() if link.task] + list(self._retiring)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for link in self._links.values():
            await self._teardown(link)
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
            if link.identity:
                self._summaries.forget(link.identity)
            log.info("peer %s (%s) left discovery", addr, link.identity)
        self._update_gauge()

    def _update_gauge(self) -> None:
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
            while True:
                self._set_state(link, "connecting")
                try:
                    await self._connect(link)
                except HandshakeError as exc:
                    if exc.reason == "self":
                        self._set_state(link, "self")
                        return
                    if exc.reason == "alias":
                        self._set_state(link, "alias")
                        await asyncio.sleep(s.dns_interval_seconds)
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
                link.last_error = ""
                self._set_state(link, "connected")
                log.info("peer %s (%s) connected", link.address, link.identity)
                try:
                    await self._pull_loop(link)
                except Exception as exc:
                    link.last_error = link.last_error or f"{type(exc).__name__}: {exc}"
                log.info("peer %s (%s) lost: %s", link.address, link.identity, link.last_error)
                await self._teardown(link)
                await self._back_off(link, "backoff")
        except asyncio.CancelledError:
            await self._teardown(link)
            raise

    async def _back_off(self, link: PeerLink, state: str) -> None:
        s = self._settings
        link.failures += 1
        delay = min(s.backoff_max_seconds, s.backoff_initial_seconds * 2 ** (link.failures - 1))
        link.retry_at = time.monotonic() + delay
        self._set_state(link, state)
        await asyncio.sleep(delay)

    async def _teardown(self, link: PeerLink) -> None:
        data, link.data, link.session = link.data, None, None
        if link.identity:
            self._summaries.forget(link.identity)
        link.failed.clear()
        if data is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(data.close(), 1.0)

    async def _establish(self, link: PeerLink) -> tuple[HelloMessage, Session, Any]:
        """Handshake with the peer at ``link.address`` and open a data connection."""
        from kv_offload_sidecar.data import connect as data_connect

        s = self._settings
        initiator = HandshakeInitiator(self._keys, self._local_hello())
        url = f"http://{link.address}/v1/handshake"
        step2 = initiator.step2(await self._post(url, initiator.step1()))
        try:
            remote, session = initiator.finish(await self._post(url, step2))
        except HandshakeError as exc:
            self._count_rejection(exc, link.address)
            raise
        if remote.identity == s.identity:
            raise HandshakeError("self", "this address is ourselves")
        other = self.connected(remote.identity)
        if other is not None and other is not link:
            link.identity = remote.identity
            raise HandshakeError("alias", f"{remote.identity} already connected via {other.address}")
        self._metrics.handshakes.labels(result="accepted", reason="ok").inc()
        data = await data_connect(remote.data_address, session.session_id, session.session_key,
                                  timeout=s.handshake_timeout_seconds, metrics=self._metrics,
                                  **self._data_options)
        return remote, session, data

    async def _connect(self, link: PeerLink) -> None:
        remote, link.session, link.data = await self._establish(link)
        link.identity = remote.identity

    async def _rekey(self, link: PeerLink) -> None:
        """Make before break: a new session with the current key, then the old one closes."""
        link.rekey = False
        try:
            remote, session, data = await self._establish(link)
        except Exception as exc:
            log.info("peer %s (%s): re-key failed (%s); keeping the current session",
                     link.address, link.identity, exc)
            return
        old, link.data, link.session = link.data, data, session
        log.info("peer %s (%s): re-keyed with pool key %s", link.address, remote.identity,
                 session.key_id.hex())
        if old is not None:  # requests still running on it finish first (they have a deadline)
            task = asyncio.create_task(self._close_later(old, self._settings.fetch_deadline_seconds + 1.0))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _close_later(data: Any, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(data.close(), 1.0)

    def keys_changed(self) -> int:
        """This sidecar's keys changed: links not on the current key re-key; returns how many."""
        current = self._keys.offered_ids()[0]
        n = 0
        for link in self._links.values():
            if link.session is not None and link.session.key_id != current:
                link.rekey = True
                n += 1
        return n

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        assert self._http is not None
        async with self._http.post(url, json=body) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = None
            if resp.status == 403 and isinstance(data, dict) and data.get("reason"):
                exc = HandshakeError(str(data["reason"]), f"peer rejected us: {data.get('error')}",
                                     [str(x) for x in data.get("diff", [])][:64])
                self._count_rejection(exc, url)
                raise exc
            if resp.status != 200:
                raise ConnectionError(f"handshake HTTP {resp.status}: "
                                      f"{data.get('error') if isinstance(data, dict) else ''}")
            return data

    def _count_rejection(self, exc: HandshakeError, where: str) -> None:
        reason = exc.reason if exc.reason in REASONS else "malformed"
        self._metrics.handshakes.labels(result="rejected", reason=reason).inc()
        log.warning("handshake with %s rejected (%s): %s%s", where, reason, exc,
                    "".join(f"\n  {line}" for line in exc.diff))

    async def _pull_loop(self, link: PeerLink) -> None:
        s = self._settings
        while True:
            if link.rekey:
                await self._rekey(link)
            await self._pull_summary(link)
            try:
                await asyncio.wait_for(link.failed.wait(), s.summary_interval_seconds)
            except asyncio.TimeoutError:
                continue
            raise ConnectionError(link.last_error or "data plane failed")

    async def _pull_summary(self, link: PeerLink) -> None:
        assert self._http is not None and link.session is not None and link.identity
        epoch, since = self._summaries.cursor(link.identity)
        ep = epoch or ""
        headers = {SESSION_HEADER: link.session.session_id.hex(),
                   AUTH_HEADER: summary_auth(link.session.session_key, ep, since)}
        url = f"http://{link.address}/v1/summary"
        timeout = aiohttp.ClientTimeout(total=max(self._settings.fetch_deadline_seconds, 5.0))
        async with self._http.get(url, params={"since": str(since), "epoch": ep},
                                  headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise ConnectionError(f"summary pull HTTP {resp.status}")
            if resp.headers.get(REKEY_HEADER) and link.session.key_id != self._keys.offered_ids()[0]:
                link.rekey = True  # the peer moved on to a key we hold too
            body = await resp.content.read(MAX_SUMMARY_REPLY_BYTES + 1)
            if len(body) > MAX_SUMMARY_REPLY_BYTES:
                raise ConnectionError("summary reply too large")
        delta = SummaryDelta.from_dict(json.loads(body))
        self._summaries.apply(link.identity, delta)
