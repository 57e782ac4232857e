"""`kv-offload fingerprint`: print the fingerprint of an OffloadingConfig JSON file."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="FILE", help="an offloading_config.json (e.g. from 'kv-offload translate')")


def run(args: argparse.Namespace) -> int:
    from kv_offload_operator.cli_translate import fail
    from kv_offload_sidecar.offloading_config import load_config_file

    try:
        config = load_config_file(args.config)
    except ValueError as exc:
        return fail(f"kv-offload fingerprint: {exc}")
    print(config.fingerprint)
    return 0
