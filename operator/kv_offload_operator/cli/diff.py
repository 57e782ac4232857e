"""`kv-offload diff`: compare the identity of two OffloadingConfig files.

Exit 0 when they share an identity (chunks are interchangeable), 1 when they
differ (one `name: a != b` line per differing field on stdout: the fingerprint's
fields, then the declared model identity's as `model_identity.revision: "abc123" !=
"def456"`), 2 on bad input. A file written before model identities declares none.
"""

from __future__ import annotations

import argparse

from kv_offload_sidecar.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="first offloading_config.json")
    parser.add_argument("b", metavar="B", help="second offloading_config.json")


def run(args: argparse.Namespace) -> int:
    from kv_offload_operator.translation.declared_identity import declared_diff, declared_digest
    from kv_offload_sidecar.engine.contract.model_identity import declared_in_file
    from kv_offload_sidecar.engine.contract.offloading_config import (
        identity_diff,
        load_config_file,
    )

    try:
        a = load_config_file(args.a)
        b = load_config_file(args.b)
        declared_a, declared_b = declared_in_file(args.a), declared_in_file(args.b)
    except ValueError as exc:
        raise UsageError(f"kv-offload diff: {exc}") from None
    lines = identity_diff(a, b) + declared_diff(declared_a, declared_b)
    if not lines:
        print(f"same identity: fingerprint {a.fingerprint}, model identity (command line) "
              f"{declared_digest(declared_a)}")
        return 0
    for line in lines:
        print(line)
    return 1
