"""What `kv-offload operator` is configured with: one frozen struct, its flags declared on its fields.

A field made with ``setting(...)`` is a flag (``setting_flags``): its default and
help are written here only, and ``cli.operator.add_arguments`` builds the parser from
them. The ``sidecar_*`` defaults are the sidecar's own (``pool_spec``, which
reads ``SidecarSettings``), so a pool that sets nothing runs a bare sidecar's
defaults; the chart passes its values over every flag it sets, and
tests/chart/test_chart_defaults_match_operator.py holds values.yaml to these
defaults. Kopf-free, so parsing the flags loads no kopf.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_offload_sidecar.setting_flags import setting
from kv_offload_sidecar.settings import PEER_COPIES, TRANSPORTS

from .pools.pool_spec import (
    DEFAULT_BASE_PORT,
    DEFAULT_DATA_PORT,
    DEFAULT_LANES,
    DEFAULT_PEER_COPIES,
    DEFAULT_PREFILL_TOKENS_PER_SECOND,
    DEFAULT_SIDECAR_IMAGE,
)


@dataclass(frozen=True)
class OperatorOptions:
    """Command-line settings handed to the startup handler through ``memo.options``."""

    sidecar_image: str = setting(DEFAULT_SIDECAR_IMAGE, "sidecar image for pools without spec.sidecar.image",
                                 default_text="$KV_OFFLOAD_SIDECAR_IMAGE, else none: each pool names "
                                              "spec.sidecar.image (the chart passes its own image)")
    webhook_addr: str = setting("0.0.0.0", "webhook listening address (0.0.0.0: all interfaces)")
    webhook_port: int = setting(9443, "webhook HTTPS port")
    webhook_host: str | None = setting(None, "host name of the webhook (the self-signed certificate's name, "
                                             "the logged URL)", default_text="the listening address")
    webhook_cert_dir: str | None = setting(None, "directory with tls.crt and tls.key (e.g. a cert-manager "
                                                 "Secret); without it a self-signed certificate is generated "
                                                 "(development only)", metavar="DIR")
    webhook_cert_check_seconds: float = setting(10.0, "seconds between checks of tls.crt/tls.key; a renewed "
                                                "pair is served without a restart", metavar="S")
    model_config_check_seconds: float = setting(60.0, "seconds between re-reads of each pool's modelConfigRef "
                                                "ConfigMap; an edited model config is translated again",
                                                metavar="S")
    key_rotation_check_seconds: float = setting(10.0, "seconds between checks of pools that ask for a pool key "
                                                "rotation (annotation kv-offload.io/rotate-pool-key) or roll "
                                                "one out", metavar="S")
    drift_check_seconds: float = setting(
        10.0, "seconds between read-backs of each pool Secret (never watched): a hand edit is reverted "
        "(a pool's ConfigMap is watched and reverted at once)", metavar="S")
    ready_peers_check_seconds: float = setting(
        15.0, "seconds between reads of every running pool sidecar's /metrics (its kvo-metrics port; by the "
        "replica that reconciles): status.readyPeers counts the sidecars that run the pool's fingerprint and "
        "have a connected peer", metavar="S")
    health_port: int = setting(8080, "liveness endpoint port, serving /healthz")
    metrics_port: int = setting(8081, "Prometheus metrics port, serving /metrics (the chart's ServiceMonitor "
                                "scrapes it)")
    peering_name: str | None = setting(
        None, "run as one of several replicas: every replica serves the webhook, the oldest one reconciles "
        "(kopf peering object NAME, created when missing); without it the operator runs alone",
        flag="--peering", metavar="NAME")
    peering_lifetime_seconds: int = setting(
        30, "seconds after which a replica that stopped answering is presumed dead and another one takes "
        "over the reconciler (with --peering)", metavar="S")
    sidecar_base_port: int = setting(DEFAULT_BASE_PORT, "control port of data-parallel rank 0 for pools "
                                     "without spec.sidecar.basePort (the chart's sidecar.controlPort)",
                                     metavar="P")
    sidecar_data_port: int = setting(DEFAULT_DATA_PORT, "tcp data-plane port for pools without "
                                     "spec.sidecar.dataPort (the chart's sidecar.dataPort)", metavar="P")
    sidecar_transport: str = setting(
        "", "data plane of pools without spec.sidecar.dataPlane.transport (the chart's "
        "sidecar.dataPlane.transport; '': per pod, tcp beside a GPU, the plane measured there, else ucx)",
        choices=("", *TRANSPORTS))
    sidecar_lanes: int = setting(
        DEFAULT_LANES, "parallel streams one fetch stripes over, for pools without spec.sidecar.dataPlane.lanes "
        "(the chart's sidecar.dataPlane.lanes; 0: one per core of the sidecar's CPU budget)", metavar="N")
    sidecar_prefill_tokens_per_second: float = setting(
        DEFAULT_PREFILL_TOKENS_PER_SECOND, "the engines' prefill rate for pools without "
        "spec.sidecar.prefillTokensPerSecond: a peer's run slower to fetch than to recompute at this rate is "
        "a miss (the chart's sidecar.prefillTokensPerSecond; 0: always fetch)", metavar="TOKENS")
    sidecar_peer_copies: str = setting(
        DEFAULT_PEER_COPIES, "what a sidecar keeps of a chunk fetched from a peer once its engine loaded it, "
        "for pools without spec.sidecar.peerCopies: drop (one copy per chunk in the pool) or cold (a copy at "
        "the cold end of the fetcher's store); the chart's sidecar.peerCopies", choices=PEER_COPIES)
    clusterwide: bool = setting(False, "watch every namespace (a ClusterKopfPeering) instead of --namespace",
                                flag="--all-namespaces", aliases=("-A",))
    # Watched namespaces, exact names (--namespace/-n, repeatable; empty with clusterwide).
    namespaces: tuple[str, ...] = ()
    # kopf peering priority (leadership.start_priority: the oldest replica is the highest).
    peering_priority: int = 0
    # This replica's name among its peers (leadership.own_identity).
    identity: str = ""
