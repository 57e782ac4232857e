"""`kv-offload translate`: vLLM serve arguments + the model's config.json -> OffloadingConfig JSON.

The JSON is the pool ConfigMap's ``offloading_config.json``: the config, its
``fingerprint`` and ``namespace_digest``, and ``model_identity`` (the fields of the
model identity the line states: ``translation.declared_identity``).

``--vllm-version X.Y`` names the vLLM release the engines run (its rules apply;
default: the newest supported). A line that release would not start with, or
cannot offload from, exits 2 with the reason."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_operator.translation.vllm_releases import NEWEST, supported


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-args", required=True, metavar="CMD",
                        help="the vLLM command line, e.g. \"vllm serve MODEL -tp 2 --kv-offloading-size 10\"")
    parser.add_argument("--model-config", required=True, metavar="FILE",
                        help="the model's Hugging Face config.json")
    parser.add_argument("--rank", type=int, default=0, metavar="N",
                        help="worker rank in [0, world_size); 0 (the scheduler side) gives the pool identity")
    parser.add_argument("--data-parallel-index", type=int, default=None, metavar="I",
                        help="global data-parallel index of the engine (default: the pod's first)")
    parser.add_argument("--vllm-version", default=None, metavar="X.Y",
                        help=f"the vLLM release the engines run, one of {supported()} "
                             f"(default: {NEWEST}, the newest)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the vLLM container (repeatable), "
                             "e.g. VLLM_USE_V2_MODEL_RUNNER=0")


def load_model_config(path: str) -> dict[str, Any]:
    """Read a HF config.json; bad input raises UsageError naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise UsageError(f"kv-offload translate: cannot read --model-config {path!r}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"kv-offload translate: --model-config {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"kv-offload translate: --model-config {path!r} must hold a JSON object (config.json)")
    return data


def run(args: argparse.Namespace) -> int:
    from kv_offload_operator.translation.declared_identity import config_json, declared_identity
    from kv_offload_operator.translation.translate import translate

    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"kv-offload translate: --env {item!r} must look like NAME=VALUE")
        env[name] = value
    model_config = load_model_config(args.model_config)
    try:
        config = translate(args.vllm_args, model_config, rank=args.rank,
                           data_parallel_index=args.data_parallel_index, env=env,
                           vllm_version=args.vllm_version)
        text = config_json(config, declared_identity(args.vllm_args, model_config))
    except ValueError as exc:
        raise UsageError(f"kv-offload translate: {exc}") from None
    sys.stdout.write(text + "\n")
    return 0
