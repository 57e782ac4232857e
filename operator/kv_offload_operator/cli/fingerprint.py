"""`kv-offload fingerprint`: print the fingerprint of an OffloadingConfig JSON file.

Line 1 is the fingerprint alone (``$(kv-offload fingerprint F | head -1)``); line 2 the
model identity the command line declared (``model_identity``) and its digest, e.g.
``model identity (command line): revision=abc123 quantization=fp8 (digest 3f2a...)``.
"""

from __future__ import annotations

import argparse

from kv_offload_sidecar.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="FILE", help="an offloading_config.json (e.g. from 'kv-offload translate')")


def run(args: argparse.Namespace) -> int:
    from kv_offload_operator.translation.declared_identity import declared_digest, describe
    from kv_offload_sidecar.engine.contract.model_identity import declared_in_file
    from kv_offload_sidecar.engine.contract.offloading_config import load_config_file

    try:
        config = load_config_file(args.config)
        declared = declared_in_file(args.config)
    except ValueError as exc:
        raise UsageError(f"kv-offload fingerprint: {exc}") from None
    print(config.fingerprint)
    print(f"model identity (command line): {describe(declared)} (digest {declared_digest(declared)})")
    return 0

