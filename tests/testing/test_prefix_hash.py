"""The prefix hash chain reproduces vLLM's hash_block_tokens / init_none_hash /
get_request_block_hasher; vectors are recomputed here from hashlib and pickle."""

import hashlib
import pickle

import pytest
from kv_offload_testing import prefix_hash as ph


def _vllm_sha256(obj):
    # vllm/utils/hashing.py sha256: pickle at the highest protocol, then SHA-256.
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_none_hash_is_hash_of_the_seed_string():
    assert ph.none_hash(ph.sha256, "0") == _vllm_sha256("0")
    assert ph.none_hash(ph.sha256, "1234") == _vllm_sha256("1234")


def test_none_hash_without_seed_is_random_per_call_like_vllm():
    a, b = ph.none_hash(ph.sha256, None), ph.none_hash(ph.sha256, None)
    assert len(a) == 32 and a != b


def test_chain_matches_independent_sha256_pickle_computation():
    tokens = list(range(1000, 1000 + 16 * 3 + 5))  # three full blocks and a partial one
    root = _vllm_sha256("42")
    expected, parent = [], root
    for b in range(3):
        parent = _vllm_sha256((parent, tuple(tokens[16 * b:16 * (b + 1)]), None))
        expected.append(parent)
    got = ph.block_hashes(tokens, 16, ph.sha256, ph.none_hash(ph.sha256, "42"))
    assert got == expected


def test_chain_hashes_extra_keys_into_every_block():
    root = ph.none_hash(ph.sha256, "0")
    plain = ph.block_hashes(list(range(32)), 16, ph.sha256, root)
    salted = ph.block_hashes(list(range(32)), 16, ph.sha256, root, extra_keys=("lora-a",))
    assert salted[0] == _vllm_sha256((root, tuple(range(16)), ("lora-a",)))
    assert all(p != s for p, s in zip(plain, salted))


def test_sha256_cbor_chain_matches_vectors_from_cbor2():
    # Computed once with cbor2.dumps(obj, canonical=True), as vLLM's sha256_cbor does.
    root = ph.none_hash(ph.sha256_cbor, "0")
    assert root.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    got = ph.block_hashes(list(range(32)), 16, ph.sha256_cbor, root)
    assert [h.hex() for h in got] == [
        "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
        "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
    ]
    salted = ph.hash_block_tokens(ph.sha256_cbor, None, range(16), ("adapter-a",), root=root)
    assert salted.hex() == "7e8957edae070452e3d1c8a9d592b11e091400bc2e0c65a5ffcabf61da25b091"


def test_offload_key_is_hash_plus_group_index_big_endian():
    h = bytes(range(32))
    key = ph.make_offload_key(h, 3)
    assert key == h + b"\x00\x00\x00\x03"
    assert ph.get_offload_block_hash(key) == h and ph.get_offload_group_idx(key) == 3


def test_offload_key_round_trip_u32_max():
    key = ph.make_offload_key(b"\xab" * 32, 2**32 - 1)
    assert ph.get_offload_group_idx(key) == 2**32 - 1


def test_chunk_key_is_last_block_hash_of_each_full_chunk():
    hashes = [bytes([i]) * 32 for i in range(10)]
    keys = ph.chunk_keys(hashes, 4, group_idx=1)
    # (chunk_idx + 1) * hashes_per_chunk - 1 -> blocks 3 and 7; blocks 8-9 are no full chunk.
    assert keys == [ph.make_offload_key(hashes[3], 1), ph.make_offload_key(hashes[7], 1)]


def test_hasher_gives_equal_keys_for_equal_prefixes_only():
    hasher = ph.PrefixHasher(16, 4, seed="0")
    a = list(range(64 * 3))
    b = a[:128] + [7] * 64
    ka, kb = hasher.chunk_keys(a), hasher.chunk_keys(b)
    assert len(ka) == len(kb) == 3
    assert ka[:2] == kb[:2] and ka[2] != kb[2]


def test_unknown_hash_algo_names_the_choices():
    with pytest.raises(ValueError, match="sha256_cbor"):
        ph.get_hash_fn("md5")
