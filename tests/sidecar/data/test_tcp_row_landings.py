"""The TCP client receives a chunk straight into a row a load job offered (``peers.row_landings``):
verified there, not stored, and never written once the job withdrew its offer. Each test runs
with chunks received on the event loop and with chunks received on the connection's own thread
(``data.tcp.stream_worker``: chunks of at least ``OFF_LOOP_BYTES``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from kv_offload_sidecar.data import IntegrityError, ReceiveStopped, connect
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.data.tcp.client import TcpPeerDataClient
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.row_landings import LandingState, LandingStore, RowLandings
from kv_offload_sidecar.store.checksum import chunk_checksum
from kv_offload_sidecar.store.chunk_store import ChunkStore
from peer_processes import PeerProcess
from prometheus_client import CollectorRegistry
from transport_peers import SESSION_ID, SESSION_KEY, chunk_bytes_in, content_of, key_of, session

GUARD = 0xEE


@pytest.fixture(params=[256 * 1024, 2 * OFF_LOOP_BYTES], ids=["on-loop", "on-thread"])
def chunk(request: pytest.FixtureRequest) -> int:
    return request.param


def _rows(n: int, chunk: int) -> list[memoryview]:
    return [memoryview(bytearray([GUARD]) * chunk) for _ in range(n)]


async def test_a_chunk_whose_row_is_offered_lands_in_the_row_verified_and_is_not_stored(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore], chunk: int) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=chunk)
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(metrics=metrics, chunk_bytes=chunk)
    woken: list[bool] = []
    landings = RowLandings(on_landed=lambda: woken.append(True))
    rows = _rows(4, chunk)
    keys = [key_of(i) for i in range(4)]
    offers = [landings.offer(keys[i], rows[i]) for i in (1, 2)]
    async with session(peer.address, metrics=metrics) as client:
        assert await client.fetch(keys, LandingStore(store, landings, metrics), timeout=10) == 4
    assert [o.state for o in offers] == [LandingState.LANDED, LandingState.LANDED]
    assert bytes(rows[1]) == content_of(1, chunk) and bytes(rows[2]) == content_of(2, chunk)
    assert bytes(rows[0]) == bytes(rows[3]) == bytes([GUARD]) * chunk  # not offered: untouched
    # The rows' chunks are not stored; the others are, and no slot is left reserved.
    assert [store.contains(k) for k in keys] == [True, False, False, True]
    assert chunk_bytes_in(store, keys[0]) == content_of(0, chunk)
    assert store.used_bytes == 2 * store.slot_stride
    assert metrics.peer_chunks_into_rows._value.get() == 2
    assert metrics.peer_bytes.labels(direction="received")._value.get() == 4 * chunk
    assert woken == [True, True]
    landings.release(offers)
    assert len(landings) == 0


async def test_a_chunk_that_fails_its_checksum_in_its_row_is_not_landed(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore], chunk: int) -> None:
    peer = start_peer("tcp", chunks=4, chunk_bytes=chunk, corrupt="1")
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(metrics=metrics, chunk_bytes=chunk)
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(key_of(1), _rows(1, chunk)[0])
    client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, metrics=metrics)
    with pytest.raises(IntegrityError, match=key_of(1).hex()):
        await client.fetch([key_of(i) for i in range(4)], LandingStore(store, landings, metrics), timeout=5)
    assert offer is not None and offer.state is LandingState.FAILED and not offer.landed
    assert not LandingStore(store, landings).contains(key_of(1)) and not store.contains(key_of(1))
    assert metrics.integrity_failures._value.get() == 1
    assert metrics.peer_chunks_into_rows._value.get() == 0
    assert store.used_bytes == len(store) * store.slot_stride  # no slot left reserved


async def _half_chunk_server(second_half: asyncio.Event, chunk: int) -> tuple[str, asyncio.AbstractServer]:
    """Authenticates anyone; answers a FETCH of key 0 with its chunk's first half, the rest
    only once ``second_half`` is set."""
    data = content_of(0, chunk)
    frame = proto.join(proto.encode_chunk(1, key_of(0), chunk_checksum(data), memoryview(data)))
    cut = len(frame) - chunk // 2

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(proto.join(proto.encode_auth_challenge(bytes(16))))
        await reader.readexactly(proto.HEADER_BYTES + 2 + len(SESSION_ID) + 32)
        writer.write(proto.join(proto.encode_auth_ok()))
        header = proto.decode_header(await reader.readexactly(proto.HEADER_BYTES))
        await reader.readexactly(header.length)
        writer.write(frame[:cut])
        await writer.drain()
        await second_half.wait()
        writer.write(frame[cut:])
        try:
            await writer.drain()
            await reader.read()
        except OSError:  # the client hung up (ConnectionError is one)
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}", server


async def test_a_withdrawn_row_is_not_written_after_its_job_ended(
        make_store: Callable[..., ChunkStore], chunk: int) -> None:
    second_half = asyncio.Event()
    address, server = await _half_chunk_server(second_half, chunk)
    store = make_store(chunk_bytes=chunk)
    landings = RowLandings(on_landed=lambda: None)
    row = _rows(1, chunk)[0]
    offer = landings.offer(key_of(0), row)
    assert offer is not None
    try:
        client = await TcpPeerDataClient.connect(address, SESSION_ID, SESSION_KEY, timeout=5)
        fetch = asyncio.create_task(client.fetch([key_of(0)], LandingStore(store, landings), timeout=30))
        async with asyncio.timeout(30):  # a safety net: the wait is on the row's bytes
            while bytes(row[:chunk // 2]) != content_of(0, chunk)[:chunk // 2]:  # first half landed
                await asyncio.wait({fetch}, timeout=0.01)
                assert not fetch.done()
        assert offer.state is LandingState.RECEIVING
        landings.release([offer])  # the load job ends: its offers go, the receive is stopped
        assert offer.state is LandingState.FAILED and client.closed
        second_half.set()
        with pytest.raises(ReceiveStopped):
            await fetch
        assert client._reader is not None and client._reader.done()  # nothing left to write the row
        assert bytes(row[chunk // 2:]) == bytes([GUARD]) * (chunk // 2)
        assert len(store) == 0 and store.used_bytes == 0
    finally:
        server.close()
