"""Offered rows: one offer per key, taken once, landed only verified, withdrawn with their job
(a receive still running is stopped), and counted present for the fetch only once landed."""

from __future__ import annotations

import os

import pytest
from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.row_landings import LandingState, LandingStore, RowLandings
from kv_offload_sidecar.store.checksum import chunk_checksum
from kv_offload_sidecar.store.chunk_store import ChunkStore
from prometheus_client import CollectorRegistry

CHUNK = 4096


@pytest.fixture
def store(shm_dir: str):
    s = ChunkStore(CHUNK, 4 * slot_stride_for(CHUNK), directory=shm_dir, name=f"landings-{os.getpid()}",
                   metrics=SidecarMetrics(CollectorRegistry()))
    yield s
    s.close()


def _key(i: int) -> bytes:
    return bytes([i]) * 32 + b"\0\0\0\0"


def test_a_key_is_offered_once_and_its_row_taken_once() -> None:
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(_key(1), memoryview(bytearray(CHUNK)))
    assert offer is not None and landings.offer(_key(1), memoryview(bytearray(CHUNK))) is None
    stops: list[str] = []
    assert offer.take(lambda: stops.append("first")) is offer.view
    assert offer.take(lambda: stops.append("second")) is None
    assert landings.landing(_key(2)) is None  # never offered
    landings.release([offer])  # still receiving: stopped once, with the first taker's stop
    assert stops == ["first"] and offer.state is LandingState.FAILED and len(landings) == 0


def test_an_open_offer_withdrawn_is_never_taken_and_frees_the_key() -> None:
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(_key(1), memoryview(bytearray(CHUNK)))
    assert offer is not None
    offer.withdraw()
    assert offer.state is LandingState.WITHDRAWN and offer.take(lambda: None) is None
    assert landings.landing(_key(1)) is None
    assert landings.offer(_key(1), memoryview(bytearray(CHUNK))) is not None  # the key is free again


def test_a_verified_chunk_in_its_row_frees_its_slot_and_counts_as_present(store: ChunkStore) -> None:
    woken: list[bool] = []
    landings = RowLandings(on_landed=lambda: woken.append(True))
    row = memoryview(bytearray(CHUNK))
    offer = landings.offer(_key(1), row)
    metrics = SidecarMetrics(CollectorRegistry())
    fetching = LandingStore(store, landings, metrics)
    res = fetching.begin_write(_key(1))
    assert res is not None and store.used_bytes == store.slot_stride  # the slot stays reserved
    view = res.receive_view(lambda: None)
    assert view is row
    data = os.urandom(CHUNK)
    view[:] = data
    assert not fetching.contains(_key(1))
    assert res.commit(chunk_checksum(data)) is True
    assert offer is not None and offer.landed and woken == [True]
    assert fetching.contains(_key(1)) and not store.contains(_key(1)) and store.used_bytes == 0
    assert metrics.peer_chunks_into_rows._value.get() == 1
    landings.release([offer])
    assert not fetching.contains(_key(1))  # the job ended: nothing is answered from its row


def test_a_chunk_in_its_row_that_fails_its_checksum_is_not_landed(store: ChunkStore) -> None:
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(_key(1), memoryview(bytearray(CHUNK)))
    res = LandingStore(store, landings).begin_write(_key(1))
    assert res is not None
    res.receive_view(lambda: None)[:] = os.urandom(CHUNK)
    assert res.commit(expected_checksum=12345) is False
    assert offer is not None and offer.state is LandingState.FAILED
    assert store.stats()["integrity_failures"] == 1 and store.used_bytes == 0
    assert landings.landing(_key(1)) is None


def test_a_key_without_an_open_offer_lands_in_its_slot(store: ChunkStore) -> None:
    landings = RowLandings(on_landed=lambda: None)
    res = LandingStore(store, landings).begin_write(_key(2))
    assert res is not None
    data = os.urandom(CHUNK)
    view = res.receive_view(lambda: None)
    view[:] = data
    assert res.commit(chunk_checksum(data)) is True
    assert store.contains(_key(2))


def test_a_chunk_in_a_row_another_load_waits_for_without_a_row_is_stored_too(store: ChunkStore) -> None:
    landings = RowLandings(on_landed=lambda: None)
    row = memoryview(bytearray(CHUNK))
    offer = landings.offer(_key(1), row)
    landings.wait([_key(1)])  # a second load, whose offer of the key was refused
    res = LandingStore(store, landings).begin_write(_key(1))
    assert res is not None and offer is not None
    data = os.urandom(CHUNK)
    res.receive_view(lambda: None)[:] = data
    assert res.commit(chunk_checksum(data)) is True
    assert offer.landed and bytes(row) == data
    pin = store.pin(_key(1))
    assert pin is not None and bytes(pin.view) == data  # the waiting load's copy, verified
    pin.release()
    landings.unwait([_key(1)])
    assert not landings.wanted(_key(1))


def test_a_corrupt_chunk_in_a_row_is_not_stored_for_a_waiting_load(store: ChunkStore) -> None:
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(_key(1), memoryview(bytearray(CHUNK)))
    landings.wait([_key(1)])
    res = LandingStore(store, landings).begin_write(_key(1))
    assert res is not None and offer is not None
    res.receive_view(lambda: None)[:] = os.urandom(CHUNK)
    assert res.commit(chunk_checksum(b"\0" * CHUNK)) is False
    assert offer.state is LandingState.FAILED and not store.contains(_key(1)) and store.used_bytes == 0


def test_a_chunk_landed_in_a_running_jobs_row_is_shared_into_the_store_until_the_job_ends(
        store: ChunkStore) -> None:
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(_key(1), memoryview(bytearray(CHUNK)))
    assert offer is not None and not landings.share(_key(1), store)  # nothing landed yet
    res = LandingStore(store, landings).begin_write(_key(1))
    assert res is not None
    data = os.urandom(CHUNK)
    res.receive_view(lambda: None)[:] = data
    assert res.commit(chunk_checksum(data)) and not store.contains(_key(1))
    assert landings.share(_key(1), store)
    pin = store.pin(_key(1))
    assert pin is not None and bytes(pin.view) == data
    pin.release()
    store.drop_when_released([_key(1)])
    landings.release([offer])  # the job gave its row back: nothing is read from it any more
    assert not landings.share(_key(1), store) and not store.contains(_key(1))
