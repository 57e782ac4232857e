"""`kv-offload install-tier DEST`: copy the vLLM-side tier into a shared volume.

The webhook runs this in an init container of the kv-offload image so the
user's vLLM image can import ``kv_offload_sidecar.engine.vllm_tier`` through
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

from kv_offload_sidecar.usage import UsageError

PACKAGE = "kv_offload_sidecar"
# The subpackage that runs inside vLLM (standard library + numpy only).
ENGINE = "engine"
# The installed package the tier is copied from (this module is in its commands/).
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def tier_files(src: Path | None = None) -> list[Path]:
    """The files the tier needs inside vLLM, relative to the package: its root ``__init__``
    and the ``engine`` subpackage, its subpackages (``engine/contract``) included."""
    src = src or PACKAGE_DIR
    return [Path("__init__.py"),
            *sorted(p.relative_to(src) for p in (src / ENGINE).rglob("*.py"))]


def install(dest: Path) -> Path:
    """Copy the tier's modules into ``dest/kv_offload_sidecar`` atomically."""
    src = PACKAGE_DIR
    files = tier_files(src)
    if not (src / ENGINE / "vllm_tier.py").exists():
        raise FileNotFoundError(f"kv-offload image is incomplete: missing {ENGINE}/vllm_tier.py")
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".kv-offload-tier-", dir=dest))
    for rel in files:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, staging / rel)
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
        raise UsageError(f"kv-offload install-tier: {exc}") from None
    print(f"installed the vLLM tier into {target}")
    return 0
