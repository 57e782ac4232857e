"""Chunk keys: vLLM's OffloadKey bytes, and the one rule every side checks them by."""

from __future__ import annotations

from collections.abc import Iterable

# Longest key accepted (bytes); vLLM's OffloadKey is 36 (32-byte hash + u32 group).
MAX_KEY_BYTES = 4096


def check_key(key: bytes) -> bytes:
    """``key`` as bytes; TypeError/ValueError naming the rule when it is not a valid key."""
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"chunk key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(
            f"chunk key length {len(key)} is out of range; keys are 1..{MAX_KEY_BYTES} bytes"
        )
    return key


def checked_keys(keys: Iterable[bytes]) -> list[bytes] | tuple[bytes, ...]:
    """``keys`` as a sequence of valid keys, checked in one pass of C-level loops.

    The common case (a list of ``bytes`` of allowed lengths) is returned as is;
    anything else goes through ``check_key`` per key (copies views, raises the
    error naming the bad key).
    """
    seq = keys if type(keys) is list or type(keys) is tuple else list(keys)
    if not seq:
        return seq
    if set(map(type, seq)) == {bytes}:
        lengths = list(map(len, seq))
        if min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES:
            return seq
    return [check_key(k) for k in seq]
