"""`kv-offload install-tier DEST`: copy the vLLM-side tier into a shared volume.

The webhook runs this in an init container of the kv-offload image so the
user's vLLM image can import ``kv_offload_sidecar.vllm_tier`` through
``PYTHONPATH=DEST`` without being rebuilt. Only the modules the tier needs at
run time are copied (standard library + numpy code); the copy is written to a
temporary folder and renamed into place, so a crashed copy is never half there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "kv_offload_sidecar"
# Modules the tier imports inside the vLLM process.
TIER_MODULES = (
    "__init__.py",
    "vllm_tier.py",
    "vllm_contract.py",
    "sidecar_match.py",
    "client.py",
    "prefix_hash.py",
    "offloading_config.py",
    "chunk_store.py",
    "checksum.py",
)


def install(dest: Path) -> Path:
    """Copy the tier modules into ``dest/kv_offload_sidecar`` atomically."""
    src = Path(__file__).resolve().parent
    missing = [m for m in TIER_MODULES if not (src / m).exists()]
    if missing:
        raise FileNotFoundError(f"kv-offload image is incomplete: missing {', '.join(missing)}")
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".kv-offload-tier-", dir=dest))
    for name in TIER_MODULES:
        shutil.copy2(src / name, staging / name)
    target = dest / PACKAGE
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dest", type=Path, help="shared volume the vLLM container adds to PYTHONPATH")


def run(args: argparse.Namespace) -> int:
    try:
        target = install(args.dest)
    except (OSError, FileNotFoundError) as exc:
        print(f"kv-offload install-tier: {exc}", file=__import__("sys").stderr)
        return 2
    print(f"installed the vLLM tier into {target}")
    return 0
