"""Chunks whose bytes are a function of their key, stored and checked through engine clients.

Every chunk a chaos run stores holds ``chunk_content(key)``, so whatever an
engine or a probe receives can be compared byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from kv_offload_sidecar.engine.client import EngineClient

if TYPE_CHECKING:
    from kv_offload_testing.local_pool import LocalPool


def chunk_content(key: bytes, nbytes: int) -> bytes:
    """Deterministic pseudo-random bytes of the chunk named ``key``."""
    seed = int.from_bytes(hashlib.sha256(b"chaos chunk\x00" + key).digest()[:8], "big")
    return np.random.Generator(np.random.PCG64(seed)).bytes(nbytes)


def chunk_keys(prefix: str, n: int) -> list[bytes]:
    """``n`` distinct chunk keys (16-byte hash + 4-byte group index, like vLLM's OffloadKey)."""
    return [hashlib.sha256(f"{prefix}/{i}".encode()).digest()[:16] + b"\x00\x00\x00\x00"
            for i in range(n)]


def store_chunks(engine: EngineClient, keys: Sequence[bytes], nbytes: int) -> int:
    """Store the deterministic content of ``keys`` through an engine client; returns chunks written."""

    def write(i: int, view: memoryview) -> None:
        view[:] = chunk_content(keys[i], nbytes)

    return engine.store(keys, write)


def load_and_verify(engine: EngineClient, keys: Sequence[bytes], nbytes: int,
                    timeout: float = 2.0) -> tuple[int, int]:
    """Load ``keys`` through an engine client; returns (chunks read, chunks whose bytes were wrong)."""
    bad = [0]

    def read(i: int, view: memoryview) -> None:
        if view != chunk_content(keys[i], nbytes):
            bad[0] += 1

    n = engine.load(keys, read, timeout)
    return n, bad[0]


def share_through_pool(pool: LocalPool, keys: Sequence[bytes], nbytes: int, *, holder: int = 0,
                       reader: int = 1, timeout: float = 2.0) -> tuple[int, int]:
    """Store ``keys`` through the engine of sidecar ``holder``, wait until the pool's chunk
    directory is current, then load them through sidecar ``reader``'s: (chunks read, chunks
    whose bytes were wrong)."""
    with pool.client(holder) as writer:
        written = store_chunks(writer, keys, nbytes)
        if written != len(keys):
            raise RuntimeError(f"sidecar {holder} stored {written} of {len(keys)} chunks")
    pool.wait_directory_current()
    with pool.client(reader) as loader:
        return load_and_verify(loader, keys, nbytes, timeout)
