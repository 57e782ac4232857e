"""`kv-offload operator`: run the kopf operator and its admission webhook.

Parses the flags into ``startup.OperatorOptions`` and runs kopf's real
runtime (``kopf.operator``) in asyncio with the handlers ``handlers.py``
registers; every kopf setting is applied by the single startup handler
(``startup.configure``). SIGTERM/SIGINT stop it cleanly. Bad flags raise
``cli.UsageError`` (exit 2); a failure to start exits 1 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from kv_offload_sidecar.usage import UsageError

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
    parser.add_argument("--health-port", type=int, default=8080,
                        help="liveness endpoint port, serving /healthz (default 8080)")
    parser.add_argument("--sidecar-image", default=DEFAULT_SIDECAR_IMAGE,
                        help="sidecar image for pools without spec.sidecar.image "
                             "(default $KV_OFFLOAD_SIDECAR_IMAGE or %(default)s)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    problem = _flag_problem(args)
    if problem:
        raise UsageError(f"kv-offload operator: {problem}")

    import kopf

    from . import handlers  # noqa: F401 (registers the handlers in kopf's default registry)
    from .startup import OperatorOptions

    options = OperatorOptions(
        sidecar_image=args.sidecar_image, webhook_addr=args.webhook_addr,
        webhook_port=args.webhook_port, webhook_host=args.webhook_host,
        webhook_cert_dir=args.webhook_cert_dir, webhook_cert_check_seconds=args.webhook_cert_check_seconds,
        model_config_check_seconds=args.model_config_check_seconds,
        key_rotation_check_seconds=args.key_rotation_check_seconds)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Its debug log prints response bodies, pool-key Secrets included: never below INFO.
    logging.getLogger("kubernetes_asyncio").setLevel(logging.INFO)
    try:
        asyncio.run(kopf.operator(
            clusterwide=args.all_namespaces,
            namespaces=args.namespace,
            standalone=True,
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
    for flag, port in (("--webhook-port", args.webhook_port), ("--health-port", args.health_port)):
        if not 1 <= port <= 65535:
            return f"{flag} {port} is not a port; use 1..65535"
    for flag, seconds in (("--webhook-cert-check-seconds", args.webhook_cert_check_seconds),
                          ("--model-config-check-seconds", args.model_config_check_seconds),
                          ("--key-rotation-check-seconds", args.key_rotation_check_seconds)):
        if not seconds > 0:
            return f"{flag} {seconds} must be positive"
    if args.webhook_port == args.health_port:
        return "--webhook-port and --health-port must differ"
    if args.webhook_cert_dir:
        missing = [f for f in ("tls.crt", "tls.key") if not os.path.isfile(os.path.join(args.webhook_cert_dir, f))]
        if missing:
            return (f"--webhook-cert-dir {args.webhook_cert_dir} has no {' or '.join(missing)}; "
                    f"mount the webhook's TLS Secret there")
    return None
