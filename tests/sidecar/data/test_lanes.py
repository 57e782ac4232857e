"""Lanes (``data.lanes``): one holder's chunks fetched over several TCP connections at once,
against a chunk server in another process; chunks large enough to move on each connection's
own thread (``tcp.stream_worker``)."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
from kv_offload_sidecar.cpu_budget import cpu_budget
from kv_offload_sidecar.data import IntegrityError, TransportError, connect
from kv_offload_sidecar.data.lanes import LanedPeerDataClient, data_lanes_of, lane_count, lanes_offered
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.row_landings import LandingState, LandingStore, RowLandings
from kv_offload_sidecar.settings import MAX_DATA_LANES
from kv_offload_sidecar.store.chunk_store import ChunkStore
from peer_processes import PeerProcess
from prometheus_client import CollectorRegistry
from transport_peers import (SESSION_ID, SESSION_KEY, assert_nothing_partial, chunk_bytes_in, content_of, key_of,
                             kill_at_first_chunk, session)

BIG = 2 * OFF_LOOP_BYTES


def test_lanes_are_the_fewer_of_both_offers_and_one_for_a_peer_that_states_none() -> None:
    assert lane_count(4, 2) == 2 and lane_count(2, 8) == 2
    assert lane_count(4, None) == 1
    assert lane_count(64, 64) == MAX_DATA_LANES
    assert lanes_offered(3) == 3 and lanes_offered(99) == MAX_DATA_LANES
    assert 1 <= lanes_offered(0) == min(MAX_DATA_LANES, cpu_budget().cpus)


async def test_a_fetch_stripes_its_chunks_over_every_lane_and_lands_them_byte_identical(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=16, chunk_bytes=BIG)
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(slots=20, chunk_bytes=BIG, metrics=metrics)
    keys = [key_of(i) for i in range(16)]
    async with session(peer.address, metrics=metrics, lanes=3) as client:
        assert isinstance(client, LanedPeerDataClient) and data_lanes_of(client) == 3
        assert await client.lookup(keys, timeout=5) == 16
        assert await client.fetch(keys, store, timeout=20) == 16
        # Chunk i went on lane i % 3: each lane asked for its share (request ids from 1).
        assert [lane._next_rid - 1 for lane in client._lanes] == [6, 5, 5]
        # The lookup went on the control connection, which carries no chunk.
        assert client._control not in client._lanes and client._control._next_rid - 1 == 1
    for i, key in enumerate(keys):
        assert chunk_bytes_in(store, key) == content_of(i, BIG)
    assert store.used_bytes == 16 * store.slot_stride  # nothing left reserved
    assert metrics.peer_bytes.labels(direction="received")._value.get() == 16 * BIG
    assert peer.metrics()["peer_bytes_sent"] == 16 * BIG


async def test_one_lane_still_has_its_own_control_connection(start_peer: Callable[..., PeerProcess]) -> None:
    peer = start_peer("tcp", chunks=2, chunk_bytes=BIG)
    async with session(peer.address, lanes=1) as client:
        assert isinstance(client, LanedPeerDataClient) and data_lanes_of(client) == 1
        assert len(client.connections) == 2 and client._control is client.connections[0]


async def test_each_fetch_starts_on_the_lane_after_the_last_ones_stripe_so_small_fetches_use_every_lane(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=4096)
    store = make_store(slots=8, chunk_bytes=4096)
    async with session(peer.address, lanes=4) as client:
        for i in range(4):  # four one-chunk fetches: one on each lane
            assert await client.fetch([key_of(i)], store, timeout=20) == 1
        assert [lane._next_rid - 1 for lane in client._lanes] == [1, 1, 1, 1]


async def test_lookups_and_heartbeats_never_share_a_connection_with_chunk_bytes(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=8, chunk_bytes=BIG)
    store = make_store(slots=10, chunk_bytes=BIG)
    keys = [key_of(i) for i in range(8)]
    async with session(peer.address, lanes=2) as client:
        got = await client.fetch_counted(keys, store, timeout=20, first=8, on_count=lambda n: None)
        assert got == 8
        await client.ping(5.0)
        control = client._control
        assert control._next_rid - 1 == 2  # the lookup and the heartbeat
        assert sum(lane._next_rid - 1 for lane in client._lanes) == 8  # every chunk on a lane
        assert peer.metrics()["peer_bytes_sent"] == 8 * BIG


async def test_a_corrupt_chunk_on_any_lane_fails_the_fetch_and_is_not_stored(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=6, chunk_bytes=BIG, corrupt="4")
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(slots=8, chunk_bytes=BIG, metrics=metrics)
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, metrics=metrics, lanes=3)
    with pytest.raises(IntegrityError, match=key_of(4).hex()):
        await client.fetch([key_of(i) for i in range(6)], store, timeout=20)
    assert not store.contains(key_of(4)) and metrics.integrity_failures._value.get() == 1
    assert client.closed and all(lane.closed for lane in client._lanes)  # every lane ends
    assert_nothing_partial(store, BIG)


async def test_a_holder_killed_mid_fetch_ends_every_lane_leaving_nothing_partial(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=24, chunk_bytes=BIG)
    store = make_store(slots=26, chunk_bytes=BIG, on_change=kill_at_first_chunk(peer.pid))
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, lanes=2)
    with pytest.raises(TransportError) as failed:
        await client.fetch([key_of(i) for i in range(24)], store, timeout=20)
    assert "deadline" not in str(failed.value)
    assert client.closed and peer.proc.wait(5) == -signal.SIGKILL  # killed at the first chunk
    assert 1 <= len(store) < 24
    assert_nothing_partial(store, BIG)


async def test_laned_chunks_land_in_offered_rows(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore]) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=BIG)
    store = make_store(slots=6, chunk_bytes=BIG)
    landings = RowLandings(on_landed=lambda: None)
    rows = [memoryview(bytearray(BIG)) for _ in range(4)]
    keys = [key_of(i) for i in range(4)]
    offers = [landings.offer(k, r) for k, r in zip(keys, rows)]
    async with session(peer.address, lanes=2) as client:
        assert client.receives_into_offered_rows
        assert await client.fetch(keys, LandingStore(store, landings), timeout=20) == 4
    assert all(o is not None and o.state is LandingState.LANDED for o in offers)
    assert [bytes(r) for r in rows] == [content_of(i, BIG) for i in range(4)]
    assert len(store) == 0
    landings.release(offers)
