"""`kv-offload fingerprint`: print the fingerprint of an OffloadingConfig JSON file."""

from __future__ import annotations

import argparse

from kv_offload_sidecar.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="FILE", help="an offloading_config.json (e.g. from 'kv-offload translate')")


def run(args: argparse.Namespace) -> int:
    from kv_offload_sidecar.engine.offloading_config import load_config_file

    try:
        config = load_config_file(args.config)
    except ValueError as exc:
        raise UsageError(f"kv-offload fingerprint: {exc}") from None
    print(config.fingerprint)
    return 0
