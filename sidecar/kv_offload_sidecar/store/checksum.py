"""Per-chunk checksum: xxHash XXH3-64 over a buffer, read in place.

The store computes it when a chunk is committed and the data plane verifies it
before a received chunk becomes visible. ``xxhash`` reads the caller's buffer
through the buffer protocol, so a ``memoryview`` over a shared-memory slot is
hashed without copying it. ``chunk_hasher`` takes the same digest piece by piece
(``CACHED_PIECE_BYTES`` each), for a copy or a transport that hashes each piece while
it is still in the cache.
"""

from __future__ import annotations

import mmap

import xxhash

# Bytes hashed at a time right after they were copied or received: what one core's cache
# holds, so the hash reads them from the cache and not from memory a second time.
CACHED_PIECE_BYTES = 1 << 20

# What chunk_checksum accepts (any C-contiguous buffer-protocol object works;
# collections.abc.Buffer only exists from Python 3.12).
BytesLike = bytes | bytearray | memoryview | mmap.mmap


def chunk_hasher() -> xxhash.xxh3_64:
    """A streaming XXH3-64: ``update`` each piece in order, then ``intdigest()`` equals
    ``chunk_checksum`` of the pieces joined."""
    return xxhash.xxh3_64()


def chunk_checksum(buf: BytesLike) -> int:
    """Return the XXH3-64 digest of ``buf`` as an unsigned 64-bit integer.

    ``buf`` is any C-contiguous object exposing the buffer protocol
    (``bytes``, ``bytearray``, ``memoryview``, ``mmap``, a numpy array).
    Raises ``TypeError`` naming the type when ``buf`` is not such a buffer.
    """
    try:
        return xxhash.xxh3_64_intdigest(buf)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(
            f"chunk_checksum needs a C-contiguous bytes-like buffer, got {type(buf).__name__} "
            f"({exc}); pass a memoryview of the chunk's contiguous bytes"
        ) from exc
