"""The sidecar's Prometheus metrics, all defined here on a registry passed in.

Names are the product's metric contract: namespace ``kv_offload``, base units in the name
(``_seconds``, ``_bytes``), counters exposed with ``_total``. Every label takes
its values from one of the small fixed tuples below and each allowed series is
pre-created with ``.labels(...)`` so dashboards see zeros instead of gaps. No
label ever carries a key, request id or peer address.

Served with prometheus_client's ``make_aiohttp_handler(registry=...)`` on the control app's ``/metrics``: anyone who
reaches the control port may read it, so nothing here says what the handshake says only
to a pool-key holder: config_info carries ``CONFIG_INFO_LABELS`` and no model or dtype
(admins read those in ``/v1/status``). ``build_info{version,wire}`` names the release and its
wire version (``peers/wire_window``), which its image tag says as well, so that a rollout shows
which releases run; what a peer agreed with each release is in ``/v1/peers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kv_offload_sidecar import __version__

NAMESPACE = "kv_offload"

# result label of chunk_lookups: where an engine lookup found a chunk.
LOOKUP_RESULTS = ("local_hit", "peer_hit", "miss")
# direction label of peer_bytes, seen from this sidecar.
PEER_BYTES_DIRECTIONS = ("sent", "received")
# result label of peer_fetches: how one fetch from a peer ended.
FETCH_RESULTS = ("ok", "miss", "timeout", "error", "integrity")
# result label of handshakes.
HANDSHAKE_RESULTS = ("accepted", "rejected")
# reason label of handshakes: "ok" for accepted ones, else why it was rejected.
HANDSHAKE_REASONS = (
    "ok",
    "fingerprint_mismatch",
    "model_mismatch",
    "hash_seed_mismatch",
    "chunk_size_mismatch",
    "wire_version_mismatch",
    "bad_proof",
    "malformed",
    "replay",
    "other_pool",
)
# state label of peers: the lifecycle of a peer session.
PEER_STATES = ("connecting", "connected", "backoff", "rejected")
# reason label of protocol_errors (also ProtocolError.reason).
PROTOCOL_ERROR_REASONS = (
    "malformed",
    "oversize",
    "unknown_type",
    "bad_key",
    "bad_size",
    "unauthenticated",
    # A request, body or handshake step not complete in time (slow or silent client).
    "timeout",
    # A connection refused at accept: its source, or all sources, hold too many unproven ones.
    "too_many_connections",
    # A handshake over its (untrusted) source's rate, answered 429 before its body is read.
    "rate_limited",
)
# state label of control_connections: whether a connection has proven anything yet (control/limits.py).
CONTROL_CONNECTION_STATES = ("unproven", "proven")
# kind label of location_messages: directory messages this sidecar sent.
LOCATION_KINDS = ("publish", "locate")
# direction label of location_bytes, seen from this sidecar.
LOCATION_BYTES_DIRECTIONS = ("sent", "received")
# kind label of route_hint_messages: an owner question, or a holder's count.
ROUTE_HINT_KINDS = ("locate", "count")
# decision label of fetch_decisions: fetch a holder's run, or leave it to the engine to recompute.
FETCH_DECISIONS = ("fetch", "recompute")
# reason label of peer_answers_given_up: nothing heard from the peer for its answer silence
# (``peers/liveness``), or the request's own deadline passed while the peer was still heard.
ANSWER_GIVE_UP_REASONS = ("silence", "deadline")
# Label names of the config_info series (one series per process). Not the model or dtype (they
# tell a stranger what the pool serves) nor the wire version (which software answers): the
# handshake says those only after the proof. The fingerprint is shown (the operator's READY
# PEERS and the mixed-fingerprint alert read it; a hash that names no model and opens nothing),
# and so is the model identity's digest ("" until the engine gave it: the pool's status counts
# the pods of each identity, e.g. old and new weights during a rolling update).
CONFIG_INFO_LABELS = ("fingerprint", "transport", "model_identity")
# Label names of the build_info series: the release (the package version) and its wire version.
BUILD_INFO_LABELS = ("version", "wire")

# Histogram buckets for one peer fetch (seconds): 0.5 ms .. 10 s, covering a
# shared-memory hop up to a multi-chunk fetch over a slow link.
FETCH_DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Allowed values per label for every labelled metric, keyed by the exported
# family name (without _total). Tests and reviewers check exposition against it.
LABEL_VALUES: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    f"{NAMESPACE}_chunk_lookups": {"result": LOOKUP_RESULTS},
    f"{NAMESPACE}_peer_bytes": {"direction": PEER_BYTES_DIRECTIONS},
    f"{NAMESPACE}_peer_fetches": {"result": FETCH_RESULTS},
    f"{NAMESPACE}_handshakes": {"result": HANDSHAKE_RESULTS, "reason": HANDSHAKE_REASONS},
    f"{NAMESPACE}_peers": {"state": PEER_STATES},
    f"{NAMESPACE}_protocol_errors": {"reason": PROTOCOL_ERROR_REASONS},
    f"{NAMESPACE}_control_connections": {"state": CONTROL_CONNECTION_STATES},
    f"{NAMESPACE}_location_messages": {"kind": LOCATION_KINDS},
    f"{NAMESPACE}_location_bytes": {"direction": LOCATION_BYTES_DIRECTIONS},
    f"{NAMESPACE}_fetch_decisions": {"decision": FETCH_DECISIONS},
    f"{NAMESPACE}_route_hint_messages": {"kind": ROUTE_HINT_KINDS},
    f"{NAMESPACE}_peer_answers_given_up": {"reason": ANSWER_GIVE_UP_REASONS},
}


# Options of the metrics in ``METRICS`` (passed on to prometheus_client).
_BYTES: Mapping[str, Any] = {"unit": "bytes"}
_SECONDS: Mapping[str, Any] = {"unit": "seconds", "buckets": FETCH_DURATION_BUCKETS}

# Every metric of the sidecar, in registration order: (type, name, label names, options, help).
# ``SidecarMetrics`` holds each as the attribute ``name`` (``name_info`` for an Info).
METRICS: tuple[tuple[type, str, tuple[str, ...], Mapping[str, Any], str], ...] = (
    (Counter, "chunk_lookups", ("result",), {},
     "Chunks looked up for the engine, by where they were found."),
    (Counter, "peer_bytes", ("direction",), _BYTES,
     "Chunk payload bytes exchanged with peer sidecars."),
    (Histogram, "peer_fetch_duration", (), _SECONDS,
     "Duration of one fetch of chunks from a peer, request to last verified byte."),
    (Histogram, "peer_fetch_first_chunk", (), _SECONDS,
     "Seconds from a fetch's first request to its first chunk landed and verified: the "
     "fixed cost of a peer hit before its bytes move (the request goes out with the lookup)."),
    (Histogram, "engine_transfer", ("op", "phase"), _SECONDS,
     "Seconds of each phase of the engine's store and load jobs on this sidecar: "
     "fetch (waiting for peer chunks), copy (bytes between vLLM's rows and the store), "
     "checksum (hashing stored chunks); lookup_to_landed: a peer fetch a lookup started, "
     "from that lookup to its last chunk landed and verified."),
    (Counter, "peer_chunks_into_rows", (), {},
     "Chunks fetched from peers that landed straight in vLLM's rows, verified (a load job "
     "offered them): neither stored here nor copied by this sidecar."),
    (Counter, "fetches_joined", (), {},
     "Loads that joined a peer fetch another load of this pod (another engine or rank) "
     "had in flight for the same keys, instead of fetching them a second time."),
    (Counter, "peer_fetches", ("result",), {}, "Fetches of chunks from peers, by outcome."),
    (Counter, "handshakes", ("result", "reason"), {},
     "Peer handshakes answered or made, by result and rejection reason."),
    (Gauge, "peers", ("state",), {}, "Known peer sidecars, by session state."),
    (Gauge, "peers_unreachable", (), {},
     "Peers that reached this sidecar (an inbound session) but that it cannot dial back "
     "(its link failed and has not connected since): this side of an asymmetric partition."),
    (Gauge, "peer_data_lanes", (), {},
     "Lanes of the open data links, all together: the data connections a fetch from one peer "
     "stripes its chunks over (tcp, ucx), or this process's read threads (nixl)."),
    (Gauge, "peer_data_links", (), {},
     "Peers with an open data connection (opened on demand, closed when idle, at most "
     "peers.data_links.MAX_DATA_LINKS)."),
    (Gauge, "store_used_bytes", (), {},
     "Bytes of the chunk store's slots in use (visible chunks and writes in progress)."),
    (Gauge, "store_capacity_bytes", (), {}, "Bytes of chunk store slots preallocated in shared memory."),
    (Gauge, "store_chunks", (), {}, "Chunks visible in the chunk store."),
    (Counter, "evictions", (), {}, "Chunks evicted from the chunk store to make room."),
    (Counter, "integrity_failures", (), {}, "Chunks dropped because their checksum did not match."),
    (Counter, "protocol_errors", ("reason",), {},
     "Malformed or refused frames and bodies from peers or clients, by reason."),
    (Gauge, "control_connections", ("state",), {},
     "Open connections to the control ports: unproven (held to the limits on strangers) or not."),
    (Counter, "lookup_messages", (), {},
     "Messages sent to peers to answer engine lookups and loads (owner queries and holder exchanges)."),
    (Counter, "engine_refusals", (), {},
     "Engine attachments refused because their model identity contradicts the pool's "
     "ConfigMap or the identity this sidecar adopted (peers/model_gate.py)."),
    (Counter, "peer_false_claims", (), {},
     "Chunks an owner or holder claimed that the holder's answer did not back (a liar is then left alone)."),
    (Counter, "location_messages", ("kind",), {},
     "Directory messages sent to peers (publishes to owners, owner queries), by kind."),
    (Counter, "location_bytes", ("direction",), _BYTES,
     "Body bytes of directory messages and their replies, both roles, by direction."),
    (Gauge, "location_entries", (), {},
     "(chunk, holder) entries this sidecar keeps for the directory buckets it owns."),
    (Counter, "fetch_decisions", ("decision",), {},
     "Holder runs the engine path decided to fetch, or to leave to the engine's prefill (slower to fetch)."),
    (Counter, "peer_answers_given_up", ("reason",), {},
     "Requests that stopped waiting for a peer's first answer (an owner's locate, a holder's "
     "count) and became misses, by reason; the exchange itself runs on to the fetch deadline. "
     "Bytes received for chunks counted as misses point here: a loaded or throttled peer."),
    (Counter, "route_hint_messages", ("kind",), {},
     "Messages sent to peers to answer routing hints (POST /v1/route), by kind."),
    (Counter, "key_reloads", (), {}, "Changes of the pool keys picked up from the mounted Secret (rotations)."),
    (Gauge, "config_rejected", (), {},
     "1 while this sidecar runs its pod's last good pool config because the config file "
     "did not load when it started (the reason is in /v1/status), else 0."),
    (Info, "config", (), {}, "Identity of the pool configuration this sidecar serves."),
    (Info, "build", (), {},
     "The kv-offload release of this sidecar and the wire version it speaks (its newest)."),
)


class SidecarMetrics:
    """Every metric of one sidecar process (``METRICS``), registered on ``registry``.

    Create one per registry (a fresh ``CollectorRegistry()`` per test); a second
    instance on the same registry raises ``ValueError`` (duplicated timeseries).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        for kind, name, labels, options, help_ in METRICS:
            metric = kind(name, help_, labels, namespace=NAMESPACE, registry=registry, **options)
            setattr(self, f"{name}_info" if kind is Info else name, metric)
        self._precreate()

    def _precreate(self) -> None:
        """Every allowed series of ``LABEL_VALUES`` at zero; a handshake's reason goes with its
        result ("ok" when accepted, any other when rejected)."""
        for family, allowed in LABEL_VALUES.items():
            metric = getattr(self, family.removeprefix(f"{NAMESPACE}_"))
            if len(allowed) == 1:
                ((label, values),) = allowed.items()
                for value in values:
                    metric.labels(**{label: value})
        self.handshakes.labels(result="accepted", reason="ok")
        for reason in HANDSHAKE_REASONS[1:]:
            self.handshakes.labels(result="rejected", reason=reason)

    def set_config_info(self, *, fingerprint: str, transport: str, model_identity: str = "") -> None:
        """Publish ``kv_offload_config_info{fingerprint,transport,model_identity} 1``."""
        self.config_info.info({"fingerprint": fingerprint, "transport": transport,
                               "model_identity": model_identity})

    def set_build_info(self, *, wire: str) -> None:
        """Publish ``kv_offload_build_info{version,wire} 1``: this release and its wire version."""
        self.build_info.info(dict(zip(BUILD_INFO_LABELS, (__version__, wire))))


def exported_metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` exposes (``..._total``, ``..._bucket``, ...).

    Used to check that dashboard PromQL only names series that exist.
    """
    return {sample.name for family in registry.collect() for sample in family.samples}
