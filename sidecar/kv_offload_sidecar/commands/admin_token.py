"""``kv-offload admin-token``: print the admin bearer token derived from a pool key file.

For holders of the pool key (``kubectl exec`` into a pool pod, or the Secret):
``curl -H "Authorization: Bearer $(kv-offload admin-token --pool-key-file
/etc/kv-offload/pool-key/key)" http://<pod>:5710/v1/status``.
"""

from __future__ import annotations

import argparse

from kv_offload_sidecar.peers.handshake import load_pool_key
from kv_offload_sidecar.peers.pool_keys import admin_token
from kv_offload_sidecar.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool-key-file", required=True, metavar="FILE",
                        help="the pool key file (key 'key' of the pool Secret)")


def run(args: argparse.Namespace) -> int:
    try:
        key = load_pool_key(args.pool_key_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(admin_token(key))
    return 0
