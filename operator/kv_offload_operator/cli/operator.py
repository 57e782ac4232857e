"""`kv-offload operator`: run the kopf operator and its admission webhook.

Parses the flags into ``options.OperatorOptions`` (each flag's default and
help declared once, on its field) and runs kopf's real
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

from kv_offload_sidecar.extras import require
from kv_offload_sidecar.setting_flags import add_flags, flag_fields, flag_values
from kv_offload_sidecar.usage import UsageError

from ..options import OperatorOptions
from kv_offload_sidecar.settings import MAX_DATA_LANES

from ..pools.pool_spec import DEFAULT_SIDECAR_IMAGE

# Environment variable naming the sidecar image when --sidecar-image is not given.
SIDECAR_IMAGE_ENV = "KV_OFFLOAD_SIDECAR_IMAGE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options' flags (defaults and help from ``OperatorOptions``), then --namespace and --verbose."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable, exact names)")
    add_flags(scope, OperatorOptions, names=("clusterwide",))
    add_flags(parser, OperatorOptions, names=_OPTION_FLAGS)
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


# Every flag of OperatorOptions but --all-namespaces, which excludes --namespace.
_OPTION_FLAGS = tuple(f.name for f, _ in flag_fields(OperatorOptions) if f.name != "clusterwide")


def run(args: argparse.Namespace) -> int:
    problem = _flag_problem(args)
    if problem:
        raise UsageError(f"kv-offload operator: {problem}")
    try:
        require("kv-offload operator", "kopf", "kubernetes_asyncio")
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    import kopf

    from .. import handlers  # noqa: F401 (registers the handlers in kopf's default registry)
    from ..leadership import own_identity, start_priority

    options = OperatorOptions(**{
        **flag_values(args, OperatorOptions), "namespaces": tuple(args.namespace),
        "sidecar_image": args.sidecar_image or os.environ.get(SIDECAR_IMAGE_ENV) or DEFAULT_SIDECAR_IMAGE,
        "peering_priority": start_priority(), "identity": own_identity()})
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Its debug log prints response bodies, pool-key Secrets included: never below INFO.
    logging.getLogger("kubernetes_asyncio").setLevel(logging.INFO)
    try:
        asyncio.run(kopf.operator(
            clusterwide=options.clusterwide,
            namespaces=list(options.namespaces),
            standalone=options.peering_name is None,
            identity=options.identity,
            liveness_endpoint=f"http://0.0.0.0:{options.health_port}/healthz",
            memo=kopf.Memo(options=options),
        ))
    except Exception as exc:  # kopf's ActivityError wraps the startup handler's PermanentError
        cause = exc.__cause__ or exc
        print(f"kv-offload operator: {' '.join(str(cause).split())}", file=sys.stderr)
        return 1
    return 0


def _flag_problem(args: argparse.Namespace) -> str | None:
    """One line saying what to change, or None when the flags are usable."""
    if not args.namespace and not args.clusterwide:
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
    if not 0 <= args.sidecar_lanes <= MAX_DATA_LANES:
        return f"--sidecar-lanes {args.sidecar_lanes} must be 0 (one per core) or 1-{MAX_DATA_LANES}"
    rate = args.sidecar_prefill_tokens_per_second
    if not (math.isfinite(rate) and rate >= 0):
        return (f"--sidecar-prefill-tokens-per-second {rate} must be a number >= 0 (the engines' prompt tokens "
                f"per second; 0 always fetches)")
    if args.peering_name is not None and not args.peering_name:
        return "--peering needs a name (the kopf peering object's), e.g. --peering kv-offload"
    if args.peering_lifetime_seconds < 5:
        return f"--peering-lifetime-seconds {args.peering_lifetime_seconds} is too short; use 5 or more"
    if args.webhook_cert_dir:
        missing = [f for f in ("tls.crt", "tls.key") if not os.path.isfile(os.path.join(args.webhook_cert_dir, f))]
        if missing:
            return (f"--webhook-cert-dir {args.webhook_cert_dir} has no {' or '.join(missing)}; "
                    f"mount the webhook's TLS Secret there")
    return None
