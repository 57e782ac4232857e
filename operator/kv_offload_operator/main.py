"""`kv-offload operator`: run the kopf operator and its admission webhook.

Parses the flags into ``startup.OperatorOptions`` and runs kopf's real
runtime (``kopf.operator``) in asyncio with the handlers ``handlers.py``
registers; every kopf setting is applied by the single startup handler
(``startup.configure``). SIGTERM/SIGINT stop it cleanly. Bad flags raise
``kv_offload_sidecar.usage.UsageError`` (exit 2); a failure to start exits 1 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys

from kv_offload_sidecar.engine.ports import DEFAULT_BASE_PORT
from kv_offload_sidecar.settings import DEFAULT_DATA_PORT, PEER_COPIES
from kv_offload_sidecar.usage import UsageError

from .pool_spec import DEFAULT_PEER_COPIES, DEFAULT_PREFILL_TOKENS_PER_SECOND

DEFAULT_SIDECAR_IMAGE = os.environ.get("KV_OFFLOAD_SIDECAR_IMAGE", "ghcr.io/kv-offload/kv-offload:0.1.0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable, exact names)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--webhook-port", type=int, default=9443, help="webhook HTTPS port (default 9443)")
    parser.add_argument("--webhook-addr", default="0.0.0.0", help="webhook listening address (default all)")
    parser.add_argument("--webhook-host", default=None,
                        help="host name of the webhook (self-signed certificate's name, logged URL)")
    parser.add_argument("--webhook-cert-dir", default=None,
                        help="directory with tls.crt and tls.key; without it a self-signed "
                             "certificate is generated (development only)")
    parser.add_argument("--webhook-cert-check-seconds", type=float, default=10.0, metavar="S",
                        help="seconds between checks of tls.crt/tls.key; a renewed pair is "
                             "served without a restart (default 10)")
    parser.add_argument("--model-config-check-seconds", type=float, default=60.0, metavar="S",
                        help="seconds between re-reads of each pool's modelConfigRef ConfigMap; "
                             "an edited model config is translated again (default 60)")
    parser.add_argument("--key-rotation-check-seconds", type=float, default=10.0, metavar="S",
                        help="seconds between checks of pools that ask for a pool key rotation "
                             "(annotation kv-offload.io/rotate-pool-key) or roll one out (default 10)")
    parser.add_argument("--ready-peers-check-seconds", type=float, default=15.0, metavar="S",
                        help="seconds between reads of every running pool sidecar's /metrics (its kvo-metrics "
                             "port; by the replica that reconciles): status.readyPeers counts the sidecars "
                             "that run the pool's fingerprint and have a connected peer (default 15)")
    parser.add_argument("--health-port", type=int, default=8080,
                        help="liveness endpoint port, serving /healthz (default 8080)")
    parser.add_argument("--metrics-port", type=int, default=8081,
                        help="Prometheus metrics port, serving /metrics (default 8081)")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="run as one of several replicas: every replica serves the webhook, the oldest "
                             "one reconciles (kopf peering object NAME, created when missing); without it "
                             "the operator runs alone")
    parser.add_argument("--peering-lifetime-seconds", type=int, default=60, metavar="S",
                        help="seconds after which a replica that stopped answering is presumed dead and "
                             "another one takes over the reconciler (with --peering; default 60)")
    parser.add_argument("--sidecar-image", default=DEFAULT_SIDECAR_IMAGE,
                        help="sidecar image for pools without spec.sidecar.image "
                             "(default $KV_OFFLOAD_SIDECAR_IMAGE or %(default)s)")
    parser.add_argument("--sidecar-base-port", type=int, default=DEFAULT_BASE_PORT, metavar="P",
                        help="control port of data-parallel rank 0 for pools without spec.sidecar.basePort "
                             "(the chart's sidecar.controlPort; default %(default)s)")
    parser.add_argument("--sidecar-data-port", type=int, default=DEFAULT_DATA_PORT, metavar="P",
                        help="tcp data-plane port for pools without spec.sidecar.dataPort "
                             "(the chart's sidecar.dataPort; default %(default)s)")
    parser.add_argument("--sidecar-prefill-tokens-per-second", type=float, default=DEFAULT_PREFILL_TOKENS_PER_SECOND,
                        metavar="TOKENS",
                        help="the engines' prefill rate for pools without spec.sidecar.prefillTokensPerSecond: a "
                             "peer's run slower to fetch than to recompute at this rate is a miss (the chart's "
                             "sidecar.prefillTokensPerSecond; default 0: always fetch)")
    parser.add_argument("--sidecar-peer-copies", choices=PEER_COPIES, default=DEFAULT_PEER_COPIES,
                        help="what a sidecar keeps of a chunk fetched from a peer once its engine loaded it, for "
                             "pools without spec.sidecar.peerCopies: drop (one copy per chunk in the pool) or "
                             "cold (a copy at the cold end of the fetcher's store); the chart's "
                             "sidecar.peerCopies (default %(default)s)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    problem = _flag_problem(args)
    if problem:
        raise UsageError(f"kv-offload operator: {problem}")

    import kopf

    from . import handlers  # noqa: F401 (registers the handlers in kopf's default registry)
    from .leadership import own_identity, start_priority
    from .startup import OperatorOptions

    options = OperatorOptions(
        sidecar_image=args.sidecar_image, webhook_addr=args.webhook_addr,
        webhook_port=args.webhook_port, webhook_host=args.webhook_host,
        webhook_cert_dir=args.webhook_cert_dir, webhook_cert_check_seconds=args.webhook_cert_check_seconds,
        model_config_check_seconds=args.model_config_check_seconds,
        key_rotation_check_seconds=args.key_rotation_check_seconds,
        ready_peers_check_seconds=args.ready_peers_check_seconds,
        metrics_port=args.metrics_port, peering_name=args.peering,
        peering_lifetime_seconds=args.peering_lifetime_seconds, peering_priority=start_priority(),
        identity=own_identity(), namespaces=tuple(args.namespace), clusterwide=args.all_namespaces,
        sidecar_base_port=args.sidecar_base_port, sidecar_data_port=args.sidecar_data_port,
        sidecar_prefill_tokens_per_second=args.sidecar_prefill_tokens_per_second,
        sidecar_peer_copies=args.sidecar_peer_copies)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Its debug log prints response bodies, pool-key Secrets included: never below INFO.
    logging.getLogger("kubernetes_asyncio").setLevel(logging.INFO)
    try:
        asyncio.run(kopf.operator(
            clusterwide=args.all_namespaces,
            namespaces=args.namespace,
            standalone=args.peering is None,
            identity=options.identity,
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
            memo=kopf.Memo(options=options),
        ))
    except Exception as exc:  # kopf's ActivityError wraps the startup handler's PermanentError
        cause = exc.__cause__ or exc
        print(f"kv-offload operator: {' '.join(str(cause).split())}", file=sys.stderr)
        return 1
    return 0


def _flag_problem(args: argparse.Namespace) -> str | None:
    """One line saying what to change, or None when the flags are usable."""
    if not args.namespace and not args.all_namespaces:
        return "give --namespace NS (repeatable) or --all-namespaces"
    ports = (("--webhook-port", args.webhook_port), ("--health-port", args.health_port),
             ("--metrics-port", args.metrics_port))
    for flag, port in ports:
        if not 1 <= port <= 65535:
            return f"{flag} {port} is not a port; use 1..65535"
    for flag, seconds in (("--webhook-cert-check-seconds", args.webhook_cert_check_seconds),
                          ("--model-config-check-seconds", args.model_config_check_seconds),
                          ("--key-rotation-check-seconds", args.key_rotation_check_seconds),
                          ("--ready-peers-check-seconds", args.ready_peers_check_seconds)):
        if not seconds > 0:
            return f"{flag} {seconds} must be positive"
    for i, (flag, port) in enumerate(ports):
        for other, other_port in ports[i + 1:]:
            if port == other_port:
                return f"{flag} and {other} must differ (both {port})"
    if not 1 <= args.sidecar_base_port <= 65000:
        return f"--sidecar-base-port {args.sidecar_base_port} is not a base port; use 1..65000"
    if not 1 <= args.sidecar_data_port <= 65535:
        return f"--sidecar-data-port {args.sidecar_data_port} is not a port; use 1..65535"
    if args.sidecar_data_port == args.sidecar_base_port:
        return f"--sidecar-data-port and --sidecar-base-port must differ (both {args.sidecar_data_port})"
    rate = args.sidecar_prefill_tokens_per_second
    if not (math.isfinite(rate) and rate >= 0):
        return (f"--sidecar-prefill-tokens-per-second {rate} must be a number >= 0 (the engines' prompt tokens "
                f"per second; 0 always fetches)")
    if args.peering is not None and not args.peering:
        return "--peering needs a name (the kopf peering object's), e.g. --peering kv-offload"
    if args.peering_lifetime_seconds < 5:
        return f"--peering-lifetime-seconds {args.peering_lifetime_seconds} is too short; use 5 or more"
    if args.webhook_cert_dir:
        missing = [f for f in ("tls.crt", "tls.key") if not os.path.isfile(os.path.join(args.webhook_cert_dir, f))]
        if missing:
            return (f"--webhook-cert-dir {args.webhook_cert_dir} has no {' or '.join(missing)}; "
                    f"mount the webhook's TLS Secret there")
    return None
