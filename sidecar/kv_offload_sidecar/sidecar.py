"""The Sidecar: wires store, metrics, control apps, data plane, discovery, location, peers.

One ``Sidecar`` per process, all on one asyncio loop. Engine operations
(``lookup``, ``load``, ``reserve``) come from the local channel or
``/v1/lookup``: the local store's prefix first, then for the remaining keys
the holder that the directory's owner names (``peers.peer_reads``: an owner
query and a holder exchange per holder the prefix spans, ``fetch_deadline_seconds``
each). An engine lookup starts the fetch and its load waits for it; the admin lookup only
counts. A failed or late peer answer is a miss and the peer is backed off.
The store's changes feed the directory (``peers.directory.location``). Metrics:
``chunk_lookups{result}`` per chunk key, ``lookup_messages``,
``peer_bytes{received}``, ``peer_fetch_duration``, ``peer_fetches{result}``,
``location_*``.

``start``/``stop`` open and close the store, the data plane, discovery and
peer links; ``lifecycle.running`` adds the local channels and control ports
around them and is the only caller of both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from kv_offload_sidecar.cpu_budget import cpu_budget
from kv_offload_sidecar.data.lanes import lanes_offered
from kv_offload_sidecar.loop_stalls import LoopStalls
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.claims import ClaimAudit
from kv_offload_sidecar.peers.discovery import Discovery, format_peer
from kv_offload_sidecar.peers.fetch_cost import FetchOrRecompute, PrefillModel
from kv_offload_sidecar.peers.handshake import HandshakeResponder, HelloMessage, Session, make_hello
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION, build_view
from kv_offload_sidecar.peers.links import PeerManager
from kv_offload_sidecar.peers.model_gate import ModelGate
from kv_offload_sidecar.peers.directory.location import Location
from kv_offload_sidecar.peers.peer_reads import PeerReads
from kv_offload_sidecar.peers.pool_keys import PoolKeys
from kv_offload_sidecar.peers.row_landings import Landing, RowLandings
from kv_offload_sidecar.peers.shared_loads import SharedLoads
from kv_offload_sidecar.peers.prefill_rate import PrefillRateLearner
from kv_offload_sidecar.peers.reachability import unreachable
from kv_offload_sidecar.peers.sessions import InboundSessions
from kv_offload_sidecar.rejections import RejectionLog
from kv_offload_sidecar.settings import DEFAULT_HASH_SEED, SidecarSettings
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_sidecar.store.handles import PinnedChunk, WriteReservation
from kv_offload_sidecar.waits import set_within

log = logging.getLogger(__name__)

# Fetch deadlines after which chunks a lookup fetched and no load took are let go.
UNLOADED_AFTER_DEADLINES = 4
# Seconds of one rejection-log window: one line per source and reason per window, then a count.
REJECTION_LOG_SECONDS = 60.0
# (source, reason) pairs the rejection log tells apart per window; more share one count line
# (two lines of ~150 bytes per pair and window: under 20 KiB of log per minute of any flood).
REJECTION_LOG_PAIRS = 64


def store_name(identity: str) -> str:
    """A file-name-safe form of the identity for the store and socket files."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", identity).strip("-.") or "sidecar"
    return name[:100]


class Sidecar:
    """One sidecar process's state and engine-facing operations."""

    def __init__(self, settings: SidecarSettings, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = SidecarMetrics(self.registry)
        cfg = settings.pool.config
        self.metrics.set_config_info(fingerprint=cfg.fingerprint, transport=settings.data_plane.transport)
        self.metrics.set_build_info(wire=WIRE_VERSION)
        # The model identity its engine gave it: nothing is shared before (peers/model_gate.py).
        self.model = ModelGate(cfg.fingerprint, settings.pool.declared_identity, self.metrics,
                               transport=settings.data_plane.transport)
        # Refused input of both ports (control and data) is noted here: one budget of lines.
        self.rejections = RejectionLog(log, interval=REJECTION_LOG_SECONDS, max_pairs=REJECTION_LOG_PAIRS)
        self.location = Location(settings.network.identity, interval_seconds=settings.peers.publish_interval_seconds,
                                 deadline_seconds=settings.peers.fetch_deadline_seconds,
                                 call=self._location_call, metrics=self.metrics)
        self.claims = ClaimAudit(on_false_claims=self.metrics.peer_false_claims.inc)
        # The live TLS contexts of the TCP data plane (renewed from their files), or None.
        self.tls = None
        if settings.security.tls_enabled:
            from kv_offload_sidecar.data.tls import TlsContexts
            self.tls = TlsContexts(settings.security.tls_cert_file, settings.security.tls_key_file,
                                   settings.security.tls_ca_file)
        self.keys = PoolKeys(settings.security.pool_key, settings.security.previous_pool_key,
                             settings.security.admin_token,
                             current_file=settings.security.pool_key_file,
                             previous_file=settings.security.previous_pool_key_file,
                             admin_file=settings.security.admin_token_file)
        self.responder = HandshakeResponder(self.keys, self.local_hello,
                                            ttl_seconds=max(10.0, 2 * settings.peers.handshake_timeout_seconds))
        self.discovery = Discovery(
            static_peers=settings.peers.static_peers, dns_name=settings.peers.peers_dns,
            base_port=settings.network.base_port, dp_size=cfg.parallel.data_parallel_size,
            interval_seconds=settings.peers.dns_interval_seconds,
            own_addresses=[format_peer(settings.network.host, p) for p in settings.network.control_ports])
        # Stalls of this process's own loop (a peer is not blamed for them).
        self.stalls = LoopStalls()
        self.peers = PeerManager(settings, self.metrics, self.discovery, self.location, self.local_hello,
                                 keys=self.keys, data_options=lambda: self._tls_options("client"),
                                 stalls=self.stalls)
        # Rows of vLLM's that load jobs offer to the peer chunks they wait for.
        self.landings = RowLandings(on_landed=self._wake_arrivals)
        self.reads = PeerReads(location=self.location, peers=self.peers, claims=self.claims,
                               metrics=self.metrics, store=self._require_store,
                               deadline_seconds=settings.peers.fetch_deadline_seconds,
                               cost=FetchOrRecompute(PrefillModel(
                                   settings.recompute.prefill_tokens_per_second, cfg.tokens_per_chunk,
                                   settings.pool.kv_bytes_per_chunk)),
                               stalls=self.stalls, landings=self.landings)
        # Loads in flight by key: one fetch per pod for a key, every job gets its rows.
        self.loads = SharedLoads(store=self._require_store, reads=self.reads, landings=self.landings,
                                 metrics=self.metrics, arrivals=lambda: self._arrived,
                                 let_go=self._release_copies, unloaded_after=lambda: (
                                     UNLOADED_AFTER_DEADLINES * settings.peers.fetch_deadline_seconds))
        # Learns the engine's prefill rate from its /metrics (--engine-metrics-url), if given.
        self.prefill_learner: PrefillRateLearner | None = None
        self.name = store_name(settings.network.identity)
        # Random per process: names this sidecar's store mapping to the engine clients.
        self.instance = secrets.token_hex(8)
        self.store: ChunkStore | None = None
        self.data_server: Any = None
        self.data_address = ""
        self.ready = False
        self._inbound = InboundSessions()
        self.metrics.peers_unreachable.set_function(
            lambda: len(unreachable(self.peers.links(), self._inbound.peers())))
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight = 0
        self._idle = asyncio.Event()
        # Set (and replaced) whenever a chunk becomes visible in the store (load_each waits on it).
        self._arrived = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle.set()

    # ---- identity and sessions ---------------------------------------------------

    @property
    def control_address(self) -> str:
        s = self.settings
        return format_peer(s.network.host, s.network.control_port(s.network.dp_indices[0]))

    def local_hello(self) -> HelloMessage:
        """A fresh hello (new nonce) describing this sidecar."""
        s = self.settings
        return make_hello(fingerprint=s.pool.config.fingerprint, hash_seed=s.pool.hash_seed,
                          kv_bytes_per_chunk=s.pool.kv_bytes_per_chunk, identity=s.network.identity,
                          control_address=self.control_address, data_address=self.data_address,
                          transport=s.data_plane.transport, run_config=s.pool.config.run_config(),
                          data_lanes=lanes_offered(s.data_plane.lanes), model_identity=self.model.identity)

    def accept_session(self, session: Session) -> None:
        """A peer proved the pool key: authorise its data connections, dial it back."""
        self._inbound.add(session)
        self.metrics.handshakes.labels(result="accepted", reason="ok").inc()
        log.info("accepted peer %s (%s)", session.peer.identity, session.peer.control_address)
        if session.peer.identity != self.settings.network.identity:
            self.discovery.add_dynamic(session.peer.control_address)
            self.peers.wake(session.peer.control_address)

    async def _location_call(self, identity: str, op: str, body: dict[str, Any], timeout: float) -> Any:
        return await self.peers.call(identity, op, body, timeout)

    def inbound_session(self, session_id: bytes) -> Session | None:
        return self._inbound.get(session_id)

    def authorize(self, session_id: bytes) -> bytes | None:
        """Data-plane callback: the session key of an authenticated inbound session."""
        session = self._inbound.get(bytes(session_id))
        return session.session_key if session else None

    def _tls_options(self, side: str) -> dict[str, Any]:
        """Data-plane options: the live TLS context of ``side`` when the pool encrypts TCP."""
        if self.tls is None:
            return {}
        return {"ssl": self.tls.server if side == "server" else self.tls.client}

    def needs_rekey(self, session: Session) -> bool:
        """The peer's session uses a key other than this sidecar's current one."""
        return session.key_id != self.keys.offered_ids()[0]

    def _reload_tls(self) -> None:
        """A renewed certificate or CA bundle (cert-manager rewrote the Secret) replaces the
        contexts: new data connections, both ways, use it (``data/tls.py``)."""
        if self.tls is None:
            return
        try:
            if self.tls.reload():
                log.info("data-plane TLS certificate renewed from %s", self.settings.security.tls_cert_file)
        except ValueError as exc:
            log.warning("keeping the TLS certificate in use: the changed files do not load: %s", exc)

    async def _reload_keys(self) -> None:
        """Follow the key files (a rotated Secret); retire sessions of keys that are gone."""
        while True:
            await asyncio.sleep(self.settings.security.key_reload_seconds)
            self._reload_tls()
            before = self.keys.offered_ids()
            gone = self.keys.reload()
            if self.keys.offered_ids() == before:
                continue
            if gone:
                self._inbound.retire(gone)
            n = self.peers.keys_changed()
            self.metrics.key_reloads.inc()
            log.info("pool keys changed: %d key(s) retired, %d peer link(s) re-keying", len(gone), n)

    # ---- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Open the store and the data plane, start discovery and peers."""
        from kv_offload_sidecar.data import make_server

        s = self.settings
        self.store = ChunkStore(s.pool.kv_bytes_per_chunk, s.store.capacity_bytes, directory=s.store.shm_dir,
                                name=self.name, metrics=self.metrics,
                                on_change=self._store_changed, replace_existing=True)
        self._loop = asyncio.get_running_loop()
        try:
            self.data_server = make_server(s.data_plane.transport, self.store, self.authorize, self.metrics,
                                           host=s.network.host, port=s.network.data_port,
                                           chunk_bytes=s.pool.kv_bytes_per_chunk, rejections=self.rejections,
                                           **self._tls_options("server"))
            self.data_address = await self.data_server.start()
        except BaseException:
            self.store.close(unlink=True)
            self.store = None
            raise
        self._tasks = [asyncio.create_task(self.discovery.run(), name="discovery"),
                       asyncio.create_task(self.model.once_known(self.peers.run), name="peers"),
                       asyncio.create_task(self.location.run(), name="location"),
                       asyncio.create_task(self._reload_keys(), name="pool keys"),
                       asyncio.create_task(self.stalls.run(), name="loop stalls")]
        if self.settings.recompute.engine_metrics_url:
            self.prefill_learner = PrefillRateLearner(
                self.settings.recompute.engine_metrics_url, self.settings.recompute.engine_metrics_interval_seconds,
                self.reads.cost.learn_rate)
            self._tasks.append(asyncio.create_task(self.prefill_learner.run(), name="prefill rate"))
        self.ready = True
        if s.pool.hash_seed == DEFAULT_HASH_SEED:
            log.warning("the prefix-hash seed is the public default %r: anyone who knows a prompt can "
                        "compute its chunk keys; give the pool a secret seed (the operator generates one "
                        "unless spec.hashSeed is set)", DEFAULT_HASH_SEED)
        log.info("sidecar %s ready: control %s, data %s, store %s (%d slots of %d bytes), %d cpus "
                 "from %s", s.network.identity, ",".join(map(str, s.network.control_ports)), self.data_address,
                 self.store.path, self.store.num_slots, self.store.slot_bytes, *cpu_budget().said)

    async def stop(self) -> None:
        """Graceful stop: in-flight engine work gets the grace bound, then close all."""
        grace = self.settings.process.shutdown_grace_seconds
        self.ready = False
        await self.wait_idle(grace)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        await self.reads.close()
        if self.data_server is not None:
            with contextlib.suppress(Exception):
                await self.data_server.stop(grace)
            self.data_server = None
        if self.store is not None:
            self.store.close(unlink=True)
            self.store = None
        log.info("sidecar %s stopped", self.settings.network.identity)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until no engine lookup/load is in flight."""
        return await set_within(self._idle, timeout)

    # ---- engine operations ------------------------------------------------------

    @contextlib.contextmanager
    def _engine_op(self) -> Iterator[None]:
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _require_store(self) -> ChunkStore:
        if self.store is None:
            raise RuntimeError("the sidecar is not running")
        return self.store

    async def lookup(self, keys: Sequence[bytes], timeout: float, *, fetch: bool = True) -> tuple[int, int]:
        """Hit prefix of ``keys``: ``(local, peer)`` lengths; counted per chunk key.

        With ``fetch`` (the engine's lookup) the peer hits start coming at once and the
        ``load`` that follows waits for them; without, nothing moves (admin lookups).
        """
        with self._engine_op():
            store = self._require_store()
            local = store.lookup_prefix(keys)
            peer = 0
            if keys:
                self.location.hint_chain(keys, held=local > 0)
            self._release_copies(store, self.reads.take_unloaded(
                UNLOADED_AFTER_DEADLINES * self.settings.peers.fetch_deadline_seconds))
            if local < len(keys):  # after a lookup of the same keys in flight (``shared_loads``)
                local, peer = await self.loads.lookup(keys, local, timeout, fetch=fetch)
            m = self.metrics.chunk_lookups
            m.labels(result="local_hit").inc(local)
            m.labels(result="peer_hit").inc(peer)
            m.labels(result="miss").inc(len(keys) - local - peer)
            return local, peer

    def _store_changed(self, key: bytes, present: bool) -> None:
        """The store's on_change: the directory records it; an arrival wakes ``load_each``."""
        self.location.record(key, present)
        if present and self._loop is not None:
            try:
                here = asyncio.get_running_loop() is self._loop
            except RuntimeError:
                here = False
            if here:
                self._wake_arrivals()
            else:
                self._loop.call_soon_threadsafe(self._wake_arrivals)

    def _wake_arrivals(self) -> None:
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

    async def load_each(self, keys: Sequence[bytes], timeout: float,
                        take: Callable[[PinnedChunk | None], None],
                        rows: Sequence[Landing | None] = ()) -> int:
        """Make the leading ``keys`` local (fetching from a peer) and hand each pin to ``take``
        as soon as its chunk is here, in key order (local ones at once, so incoming chunks
        cannot evict them; fetched ones as they land), so the caller can copy a chunk while
        the next is still on the wire. ``rows``: the rows the caller offered per key
        (``row_landings``); a chunk that landed in its row is handed over as None, and a
        pin is never taken for a row a transport is receiving into. Loads of the same keys
        share one fetch (``peers.shared_loads``). Returns how many keys it handed over; the
        caller releases the pins."""
        with self._engine_op():
            return await self.loads.load_each(keys, timeout, take, rows)

    async def load(self, keys: Sequence[bytes], timeout: float) -> list[PinnedChunk]:
        """Make the leading ``keys`` local (fetching from a peer) and pin them: ``load_each``
        collecting the pins. Returns pins for the hit prefix; the caller releases them (on an
        error none is left pinned)."""
        pins: list[PinnedChunk] = []

        def take(pin: PinnedChunk | None) -> None:
            if pin is not None:  # always: no rows are offered here
                pins.append(pin)

        try:
            await self.load_each(keys, timeout, take)
        except BaseException:
            for p in pins:
                p.release()
            raise
        return pins

    def _release_copies(self, store: ChunkStore, keys: list[bytes]) -> None:
        if self.settings.store.peer_copies == "drop":
            store.drop_when_released(keys)
        else:
            store.demote(keys)

    async def route_hint(self, keys: Sequence[bytes], timeout: float) -> list[dict[str, Any]]:
        """Pods holding the longest prefixes of ``keys`` (this one included), longest first:
        ``{"pod", "address", "chunks"}`` with ``address`` the pod's control address. Nothing moves
        and no LRU order changes: a gateway asks before it picks a replica."""
        local = self._require_store().lookup_prefix(keys, touch=False)
        out = []
        if local:
            out.append({"pod": self.settings.network.identity, "address": self.control_address, "chunks": local})
        for link, n in await self.reads.prefix_holders(keys, timeout):
            out.append({"pod": link.identity, "address": link.address, "chunks": n})
        out.sort(key=lambda h: -h["chunks"])
        return out

    def reserve(self, keys: Sequence[bytes]) -> list[WriteReservation | None]:
        """Write reservations for ``keys`` (None where present, being written or full)."""
        store = self._require_store()
        self.location.hint_chain(keys)
        return [store.begin_write(k) for k in keys]

    # ---- views ------------------------------------------------------------------

    def peers_view(self) -> list[dict[str, Any]]:
        out = []
        for link in self.peers.links():
            v = link.view()
            v["member"] = link.member
            v["wire_version"] = link.session.peer.wire_version if link.session else None  # agreed
            v["entries"] = self.location.directory.entries_of(link.identity) if link.identity else 0
            out.append(v)
        return out

    def status(self) -> dict[str, Any]:
        s = self.settings
        store = self.store
        ucx: dict[str, int] = {}
        if s.data_plane.transport == "ucx":
            from kv_offload_sidecar.data.ucx.runtime import configured_lanes
            ucx["ucx_lanes"] = configured_lanes()
        states: dict[str, int] = {}
        for link in self.peers.links():
            states[link.state] = states.get(link.state, 0) + 1
        return {
            "identity": s.network.identity,
            "ready": self.ready,
            "fingerprint": s.pool.config.fingerprint,
            "model": s.pool.config.model.name,
            "model_identity": self.model.view(),  # None: no engine stated it yet
            "declared_model_identity": dict(s.pool.declared_identity),
            "kv_bytes_per_chunk": s.pool.kv_bytes_per_chunk,
            **build_view(),  # version, wire_version and the range spoken (wire_min, wire_max)
            "transport": s.data_plane.transport,
            **ucx,
            "control_ports": list(s.network.control_ports),
            "dp_indices": list(s.network.dp_indices),
            "data_address": self.data_address,
            "peers": states,
            # Lanes this sidecar offers; each connected peer's count is in /v1/peers.
            "data_lanes_offered": lanes_offered(s.data_plane.lanes),
            "cpu_budget": cpu_budget().view(),  # cores lanes and thread pools follow, and from where
            **self.peers.data_view(),  # data_lanes of each open data link, data_links: their bound
            "inbound_sessions": len(self._inbound),
            "engine_requests_in_flight": self._inflight,
            "peer_fetches_in_flight": self.reads.fetches_in_flight,
            "loop_stalls": self.stalls.view(),
            "store": None if store is None else {
                "path": store.path, "num_slots": store.num_slots, "slot_bytes": store.slot_bytes,
                "slot_stride": store.slot_stride, "capacity_bytes": store.capacity_bytes,
                "used_bytes": store.used_bytes, "chunks": len(store)},
            "location": self.location.status(),
            "fetch_or_recompute": {
                "prefill_tokens_per_second": self.reads.cost.model.prefill_tokens_per_second,
                "learnt_from": s.recompute.engine_metrics_url if self.reads.cost.learnt else "",
                "peers": self.reads.cost.speeds.view()},
        }

    def local_socket_path(self, dp_index: int) -> str:
        return f"{self.settings.store.shm_dir.rstrip('/')}/kv-offload-{self.name}-dp{dp_index}.sock"

    def local_info(self, dp_index: int, model_identity: Any = None,
                   fingerprint: Any = None) -> dict[str, Any]:
        """What an engine checks; the identity it states goes to the gate (a refusal comes back)."""
        store = self._require_store()
        refused = "" if model_identity is None else self.model.offer(model_identity, fingerprint)
        return {
            "socket": self.local_socket_path(dp_index),
            "dp_index": dp_index,
            "identity": self.settings.network.identity,
            "instance": self.instance,
            "fingerprint": self.settings.pool.config.fingerprint,
            # The identity fields behind the fingerprint, so an engine can name what differs.
            "run_config": self.settings.pool.config.run_config(),
            "kv_bytes_per_chunk": self.settings.pool.config.kv_bytes_per_chunk,
            "hash_seed": self.settings.pool.hash_seed,
            "model_identity": None if self.model.identity is None else self.model.identity.digest,
            "model_identity_refused": refused,  # why the engine that asked is refused, or ""
            "store": {"path": store.path, "slot_bytes": store.slot_bytes,
                      "slot_stride": store.slot_stride, "num_slots": store.num_slots},
        }

