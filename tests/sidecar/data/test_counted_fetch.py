"""One holder exchange: the count comes back before the chunks, and nothing past it is asked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kv_offload_sidecar.data import connect
from kv_offload_sidecar.store.chunk_store import ChunkStore
from peer_processes import PeerProcess
from transport_peers import SESSION_ID, SESSION_KEY, chunk_bytes_in, content_of, key_of
from waiting import wait_for_async

CHUNK = 256 * 1024


async def test_the_count_arrives_before_the_chunks_and_bounds_what_is_fetched(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=8, chunk_bytes=CHUNK)
    store = make_store(slots=40)
    keys = [key_of(i) for i in range(8)] + [key_of(900 + i) for i in range(24)]
    seen: list[tuple[int, int]] = []  # (count, chunks already in the store when it came)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    try:
        got = await client.fetch_counted(keys, store, 10.0, first=2,
                                         on_count=lambda n: seen.append((n, len(store))))
        assert got == 8
        assert seen == [(8, seen[0][1])] and seen[0][1] <= 2  # only the first window came before it
        # The holder counts a chunk once its send returned, which may be after it landed here.
        sent = await wait_for_async("the holder counted its 8 chunks sent",
                                    lambda: (n := peer.metrics()["peer_bytes_sent"]) >= 8 * CHUNK and n)
        assert sent == 8 * CHUNK
        assert len(store) == 8 and all(chunk_bytes_in(store, key_of(i)) == content_of(i, CHUNK)
                                       for i in range(8))
        # A holder without the first key: a count of 0, at most the first window asked, no chunk.
        missing = [key_of(950)] + keys[:8]
        counts: list[int] = []
        assert await client.fetch_counted(missing, store, 5.0, first=1, on_count=counts.append) == 0
        assert counts == [0] and len(store) == 8
        assert store.used_bytes == len(store) * store.slot_stride  # no slot left reserved
    finally:
        await client.close()


async def test_a_fetch_cancelled_once_every_chunk_is_in_leaves_the_connection_serving(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    # A load that holds every chunk stops waiting for the exchange (it cancels it): with
    # nothing still on the wire the connection is not torn down (a reconnect costs a handshake).
    peer = start_peer("tcp", chunks=8, chunk_bytes=CHUNK)
    keys = [key_of(i) for i in range(8)]
    fetching: list[asyncio.Task[int]] = []

    def cancel_when_all_in(_key: bytes, present: bool) -> None:
        if present and len(store) == len(keys):
            fetching[0].cancel()

    store = make_store(slots=20, on_change=cancel_when_all_in)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    try:
        fetching.append(asyncio.create_task(client.fetch(keys, store, 10.0)))
        with pytest.raises(asyncio.CancelledError):
            await fetching[0]
        assert len(store) == len(keys) and not client.closed
        assert await client.lookup(keys, 5.0) == len(keys)  # the same connection still answers
    finally:
        await client.close()
