"""weights_digest: other weights under one path tell apart, by reading a bounded sample."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from kv_offload_sidecar.engine.weights_digest import (
    MAX_TENSOR_SAMPLES,
    SAMPLE_BYTES,
    directory_digest,
    hub_snapshot,
    weights_identity,
)


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file as the format defines it: u64 header length, JSON header, data."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = array.astype(np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def model(directory, seed: int, layers: int = 4, rows: int = 256) -> str:
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_safetensors(os.path.join(directory, "model.safetensors"),
                      {f"layers.{i}.weight": rng.standard_normal((rows, 64)) for i in range(layers)})
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump({"model_type": "llama"}, fh)
    return str(directory)


def test_the_same_weights_at_another_path_have_the_same_identity(tmp_path):
    a = model(tmp_path / "a", seed=1)
    b = shutil.copytree(a, tmp_path / "b")
    assert directory_digest(a).identity == directory_digest(str(b)).identity
    assert directory_digest(a).identity.startswith("files:")


def test_retrained_weights_at_the_same_path_have_another_identity(tmp_path):
    path = model(tmp_path / "m", seed=1)
    before = weights_identity(path)
    model(tmp_path / "m", seed=2)  # a rollout rewrote the weights in place
    assert weights_identity(path).identity != before.identity


def test_one_fine_tuned_tensor_changes_the_identity(tmp_path):
    path = model(tmp_path / "m", seed=1)
    before = directory_digest(path).identity
    rng = np.random.default_rng(1)
    tensors = {f"layers.{i}.weight": rng.standard_normal((256, 64)) for i in range(4)}
    tensors["layers.2.weight"] = tensors["layers.2.weight"] + 1e-3
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    assert directory_digest(path).identity != before


def test_the_identity_reads_the_header_and_a_bounded_sample_of_each_tensor(tmp_path):
    path = model(tmp_path / "m", seed=1, layers=MAX_TENSOR_SAMPLES + 100, rows=64)
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    got = directory_digest(path)
    with open(os.path.join(path, "model.safetensors"), "rb") as fh:
        header = 8 + struct.unpack("<Q", fh.read(8))[0]
    assert got.files == 1
    assert got.read_bytes <= header + 2 * SAMPLE_BYTES * MAX_TENSOR_SAMPLES
    assert got.read_bytes < size  # not the whole file


def test_a_directory_without_weight_files_is_unknown_and_says_why(tmp_path):
    got = weights_identity(str(tmp_path))
    assert got.identity == "" and "no weight files" in got.reason


def test_a_hub_model_is_named_by_the_snapshot_its_revision_resolves_to(tmp_path):
    repo = tmp_path / "hub" / "models--org--model"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v2").write_text("b" * 40)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert weights_identity("org/model", None, env).identity == f"hf:org/model@{'a' * 40}"
    assert weights_identity("org/model", "v2", env).identity == f"hf:org/model@{'b' * 40}"
    assert hub_snapshot("org/model", "b" * 40, env) == "b" * 40
    missing = weights_identity("org/other", None, env)
    assert missing.identity == "" and "neither a local directory nor a snapshot" in missing.reason


@pytest.mark.parametrize("name", ["../etc", "/abs/path", "no-slash"])
def test_names_that_are_not_hub_ids_find_no_snapshot(tmp_path, name):
    assert hub_snapshot(name, None, {"HF_HUB_CACHE": str(tmp_path)}) == ""
