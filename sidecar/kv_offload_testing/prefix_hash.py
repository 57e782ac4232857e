"""vLLM's prefix hash chain and chunk keys, reproduced with the standard library.

vLLM (``vllm/v1/core/kv_cache_utils.py``) hashes each full block of
``tokens_per_hash`` tokens as ``hash_fn((parent_hash, tuple(token_ids),
extra_keys))``, where the parent of the first block is ``NONE_HASH`` =
``hash_fn(PYTHONHASHSEED)`` (32 random bytes when the variable is unset, which
makes hashes unshareable between processes). The default
``--prefix-caching-hash-algo`` is ``sha256``: SHA-256 over
``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``; ``sha256_cbor`` hashes
canonical CBOR instead (encoded here for the types a block key holds).

The offloading connector names a chunk by its ``OffloadKey``: the hash of the
chunk's last block followed by the KV-cache group index as 4 bytes big-endian.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

HashFn = Callable[[Any], bytes]
# Bytes appended to a block hash to form an OffloadKey.
GROUP_IDX_BYTES = 4


def sha256(obj: Any) -> bytes:
    """vLLM's default ``sha256``: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of canonical CBOR (RFC 8949 §4.2.1)."""
    return hashlib.sha256(cbor_encode(obj)).digest()


HASH_FUNCTIONS: Mapping[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor}


def get_hash_fn(name: str) -> HashFn:
    """The hash function of a ``--prefix-caching-hash-algo`` name."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"prefix-caching hash algo {name!r} is not supported; "
                         f"use one of {sorted(HASH_FUNCTIONS)}") from None


def none_hash(hash_fn: HashFn, seed: str | None) -> bytes:
    """The chain's root, as vLLM's ``init_none_hash``.

    ``seed`` is the ``PYTHONHASHSEED`` string; ``None`` gives 32 random bytes
    (vLLM's behaviour when the variable is unset).
    """
    return os.urandom(32) if seed is None else hash_fn(seed)


def hash_block_tokens(hash_fn: HashFn, parent_block_hash: bytes | None,
                      token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None,
                      *, root: bytes) -> bytes:
    """One link of the chain; a falsy parent means the first block (``root``)."""
    parent = parent_block_hash if parent_block_hash else root
    return hash_fn((parent, tuple(token_ids), extra_keys))


def block_hashes(token_ids: Sequence[int], tokens_per_hash: int, hash_fn: HashFn, root: bytes,
                 extra_keys: tuple[Any, ...] | None = None) -> list[bytes]:
    """Hashes of every full block of ``tokens_per_hash`` tokens, in order.

    Same result as vLLM's ``get_request_block_hasher`` for a request without
    multimodal inputs, LoRA or cache salt when ``extra_keys`` is None.
    """
    if tokens_per_hash <= 0:
        raise ValueError(f"tokens_per_hash must be positive, got {tokens_per_hash}")
    out: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - tokens_per_hash + 1, tokens_per_hash):
        parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + tokens_per_hash],
                                   extra_keys, root=root)
        out.append(parent)
    return out


def make_offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """vLLM's ``OffloadKey``: the block hash + group index (4 bytes, big-endian)."""
    return bytes(block_hash) + group_idx.to_bytes(GROUP_IDX_BYTES, "big", signed=False)


def get_offload_block_hash(key: bytes) -> bytes:
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: bytes) -> int:
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big", signed=False)


def chunk_keys(hashes: Sequence[bytes], hashes_per_chunk: int, group_idx: int = 0) -> list[bytes]:
    """The OffloadKey of every full chunk: ``hashes[(c + 1) * hashes_per_chunk - 1]``."""
    if hashes_per_chunk <= 0:
        raise ValueError(f"hashes_per_chunk must be positive, got {hashes_per_chunk}")
    return [make_offload_key(hashes[(c + 1) * hashes_per_chunk - 1], group_idx)
            for c in range(len(hashes) // hashes_per_chunk)]


class PrefixHasher:
    """A configured chain: hash algo, seed and block geometry of one pool."""

    def __init__(self, tokens_per_hash: int, hashes_per_chunk: int, *, seed: str | None,
                 hash_algo: str = "sha256") -> None:
        self.tokens_per_hash = tokens_per_hash
        self.hashes_per_chunk = hashes_per_chunk
        self.hash_fn = get_hash_fn(hash_algo)
        self.root = none_hash(self.hash_fn, seed)

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_hash * self.hashes_per_chunk

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return block_hashes(token_ids, self.tokens_per_hash, self.hash_fn, self.root)

    def chunk_keys(self, token_ids: Sequence[int], group_idx: int = 0) -> list[bytes]:
        return chunk_keys(self.block_hashes(token_ids), self.hashes_per_chunk, group_idx)


# ---- canonical CBOR for the values a block key holds ------------------------

def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([(major << 5) | n])
    for info, fmt, limit in ((24, "!B", 1 << 8), (25, "!H", 1 << 16),
                             (26, "!I", 1 << 32), (27, "!Q", 1 << 64)):
        if n < limit:
            return bytes([(major << 5) | info]) + struct.pack(fmt, n)
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit head")


def cbor_encode(obj: Any) -> bytes:
    """Canonical CBOR of None, bools, ints, bytes, str, tuples/lists and str/int-keyed dicts."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        if obj >= 0:
            if obj < 1 << 64:
                return _cbor_head(0, obj)
            raw = obj.to_bytes((obj.bit_length() + 7) // 8, "big")
            return b"\xc2" + _cbor_head(2, len(raw)) + raw
        m = -1 - obj
        if m < 1 << 64:
            return _cbor_head(1, m)
        raw = m.to_bytes((m.bit_length() + 7) // 8, "big")
        return b"\xc3" + _cbor_head(2, len(raw)) + raw
    if isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        return _cbor_head(2, len(raw)) + raw
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(cbor_encode(x) for x in obj)
    if isinstance(obj, dict):
        items = sorted((cbor_encode(k), cbor_encode(v)) for k, v in obj.items())
        # Canonical order: shorter encoded keys first, then bytewise.
        items.sort(key=lambda kv: (len(kv[0]), kv[0]))
        return _cbor_head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(f"cannot CBOR-encode a {type(obj).__name__} in a block key")
