"""The identity of a model's weights: a hub snapshot's commit, or a digest of local weight files.

``weights_identity(model, revision)``:
- ``model`` is a directory (a local path, a PVC, an image layer): ``files:<16 hex>``, the
  digest of its weight files (``WEIGHT_SUFFIXES``, found at the top and one level down):
  each file's relative name and size and, for safetensors, its JSON header (every
  tensor's name, dtype, shape and offsets) and ``SAMPLE_BYTES`` from the start and the
  middle of each tensor (at most ``MAX_TENSOR_SAMPLES`` tensors, spread over the file);
  other formats are sampled at ``OTHER_SAMPLES`` evenly spaced offsets. A retrained or
  fine-tuned checkpoint differs in its tensors' bytes, so a sample of each tensor tells
  it apart; nothing reads whole files.
- ``model`` is a hub repository id whose snapshot is in the local Hugging Face cache
  (vLLM downloaded it before the tier starts): ``hf:<repo>@<commit>``, the commit the
  asked revision (default ``main``) resolves to in ``refs/``, else the only snapshot.
- Otherwise "" (unknown): the pod shares nothing, and says why.

What it costs: per safetensors file its header (tens of KiB to a few MiB for the largest
checkpoints) and at most 2 x ``SAMPLE_BYTES`` x ``MAX_TENSOR_SAMPLES`` = 4 MiB of samples
(about 2 x 291 reads of 4 KiB, 2.3 MiB, for Llama-3.1-8B's 4 files); a hub snapshot costs
one read of a ref file. ``weights_read_bytes`` of the result says what was read.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")
# Bytes read at each sampled offset.
SAMPLE_BYTES = 4096
# Tensors of one safetensors file sampled (spread evenly when it has more).
MAX_TENSOR_SAMPLES = 512
# Offsets sampled in a weight file of another format.
OTHER_SAMPLES = 64
# Largest safetensors header read (the format allows 100 MB; real headers are far smaller).
MAX_HEADER_BYTES = 100 << 20
DIGEST_HEX_LEN = 16


@dataclass(frozen=True)
class WeightsIdentity:
    # "hf:<repo>@<commit>", "files:<16 hex>" or "" (unknown).
    identity: str
    # Weight files read (0 for a hub snapshot).
    files: int
    # Bytes read to compute it.
    read_bytes: int
    # Why the weights are unknown ("" when known).
    reason: str = ""


def weights_identity(model: str, revision: str | None = None,
                     environ: dict[str, str] | None = None) -> WeightsIdentity:
    """The identity of the weights vLLM loaded for ``model`` (see the module docstring)."""
    if os.path.isdir(model):
        return directory_digest(model)
    snapshot = hub_snapshot(model, revision, os.environ if environ is None else environ)
    if snapshot:
        return WeightsIdentity(f"hf:{model}@{snapshot}", 0, 0)
    return WeightsIdentity("", 0, 0, f"{model!r} is neither a local directory nor a snapshot in "
                           f"the Hugging Face cache (HF_HUB_CACHE / HF_HOME)")


def directory_digest(path: str) -> WeightsIdentity:
    """``files:<16 hex>`` over the weight files under ``path`` (top level and one below)."""
    h = hashlib.sha256(b"kv-offload weights v1\x00")
    read = 0
    files = _weight_files(path)
    for rel in files:
        full = os.path.join(path, rel)
        size = os.path.getsize(full)
        h.update(f"{rel}\x00{size}\x00".encode())
        with open(full, "rb") as fh:
            if rel.endswith(".safetensors"):
                read += _safetensors_samples(fh, size, h)
            else:
                read += _even_samples(fh, size, 0, OTHER_SAMPLES, h)
    if not files:
        return WeightsIdentity("", 0, 0, f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path!r}")
    return WeightsIdentity(f"files:{h.hexdigest()[:DIGEST_HEX_LEN]}", len(files), read)


def _weight_files(path: str) -> list[str]:
    out = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if os.path.isfile(full) and entry.endswith(WEIGHT_SUFFIXES):
            out.append(entry)
        elif os.path.isdir(full) and not entry.startswith("."):
            out.extend(f"{entry}/{sub}" for sub in sorted(os.listdir(full))
                       if sub.endswith(WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(full, sub)))
    return out


def _safetensors_samples(fh, size: int, h) -> int:
    """Hash the header and a sample of each tensor's start and middle; bytes read."""
    head = fh.read(8)
    if len(head) < 8:
        h.update(head)
        return len(head)
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_HEADER_BYTES, size - 8):
        return 8 + _even_samples(fh, size, 8, OTHER_SAMPLES, h)  # not a safetensors header
    header = fh.read(n)
    h.update(header)
    read = 8 + n
    try:
        tensors = json.loads(header)
    except ValueError:
        return read + _even_samples(fh, size, 8 + n, OTHER_SAMPLES, h)
    spans = sorted(v["data_offsets"] for k, v in tensors.items()
                   if k != "__metadata__" and isinstance(v, dict)
                   and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2)
    if len(spans) > MAX_TENSOR_SAMPLES:
        step = len(spans) / MAX_TENSOR_SAMPLES
        spans = [spans[int(i * step)] for i in range(MAX_TENSOR_SAMPLES)]
    base = 8 + n
    for start, end in spans:
        for at in (start, start + (end - start) // 2):
            fh.seek(base + int(at))
            chunk = fh.read(min(SAMPLE_BYTES, max(0, int(end) - int(at))))
            h.update(chunk)
            read += len(chunk)
    return read


def _even_samples(fh, size: int, start: int, count: int, h) -> int:
    span = max(0, size - start)
    read = 0
    for i in range(count):
        fh.seek(start + span * i // count)
        chunk = fh.read(SAMPLE_BYTES)
        h.update(chunk)
        read += len(chunk)
    return read


def hub_cache_dir(environ: dict[str, str]) -> str:
    """The Hugging Face hub cache as huggingface_hub resolves it."""
    if environ.get("HF_HUB_CACHE"):
        return environ["HF_HUB_CACHE"]
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return os.path.join(home, "hub")


def hub_snapshot(repo: str, revision: str | None, environ: dict[str, str]) -> str:
    """The commit ``revision`` of hub ``repo`` resolves to in the local cache ("" when absent)."""
    if repo.count("/") != 1 or repo.startswith((".", "/")):
        return ""
    root = os.path.join(hub_cache_dir(environ), "models--" + repo.replace("/", "--"))
    rev = revision or "main"
    snapshots = os.path.join(root, "snapshots")
    if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) and os.path.isdir(
            os.path.join(snapshots, rev)):
        return rev
    try:
        with open(os.path.join(root, "refs", rev), encoding="ascii") as fh:
            commit = fh.read(100).strip()
    except (OSError, UnicodeDecodeError):
        commit = ""
    if commit and os.path.isdir(os.path.join(snapshots, commit)):
        return commit
    if revision is None and os.path.isdir(snapshots):
        present = sorted(os.listdir(snapshots))
        if len(present) == 1:
            return present[0]
    return ""


__all__ = ["WeightsIdentity", "directory_digest", "hub_snapshot", "weights_identity"]
