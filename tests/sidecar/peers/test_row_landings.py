"""Offered rows: one offer per key, taken once, landed only verified, withdrawn with their job
(a receive still running is stopped), and counted present for the fetch only once landed."""

from __future__ import annotations

import os
import threading

import pytest
from kv_offload_sidecar.data.write_gates import LateWrite, WriteGate
from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.row_landings import LandingState, LandingStore, RowLandings
from kv_offload_sidecar.store.checksum import chunk_checksum
from kv_offload_sidecar.store.chunk_store import ChunkStore
from prometheus_client import CollectorRegistry
from waiting import SAFETY_SECONDS

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


def _commit_paused_at_the_row(res, offer, data: bytes):  # noqa: ANN001, ANN202 (test helper)
    """Start ``res``'s commit on a thread of its own (as a TCP lane's thread commits) and hold
    it where it is about to read its row or mark it landed (``Landing.before_landing``);
    returns (resume, result: the commit's outcome once joined)."""
    at_row, resume = threading.Event(), threading.Event()

    def pause() -> None:
        at_row.set()
        assert resume.wait(SAFETY_SECONDS)

    offer.before_landing = pause
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(
        res.commit(chunk_checksum(data), computed_checksum=chunk_checksum(data))))
    thread.start()
    assert at_row.wait(SAFETY_SECONDS)  # the chunk is verified; the commit is about to use the row

    def finish() -> bool:
        resume.set()
        thread.join(SAFETY_SECONDS)
        assert not thread.is_alive()
        return result[0]
    return finish


@pytest.mark.parametrize("waiting_load", [False, True])
def test_a_withdrawal_racing_a_lane_threads_commit_leaves_nothing_landed_in_the_given_back_row(
        store: ChunkStore, waiting_load: bool) -> None:
    landings = RowLandings(on_landed=lambda: None)
    row = memoryview(bytearray(CHUNK))
    offer = landings.offer(_key(1), row)
    if waiting_load:  # a second load without a row: the commit would copy the row into a slot
        landings.wait([_key(1)])
    fetching = LandingStore(store, landings)
    res = fetching.begin_write(_key(1))
    assert res is not None and offer is not None
    gate, stops = WriteGate(), []
    data = os.urandom(CHUNK)
    view = res.receive_view(lambda: stops.append("stopped"), gate)
    with gate.writing(CHUNK):
        view[:] = data
    finish = _commit_paused_at_the_row(res, offer, data)
    landings.release([offer])  # the job ends and gives its rows back while the commit is paused
    assert stops == ["stopped"] and offer.state is LandingState.FAILED
    with pytest.raises(LateWrite):  # no write into the given-back row starts after the withdrawal
        with gate.writing(CHUNK):
            row[:] = b"\0" * CHUNK
    assert finish() is False and res.refused == "its row's load job had already ended"
    assert offer.state is LandingState.FAILED and not offer.landed and not fetching.contains(_key(1))
    assert not store.contains(_key(1)) and store.used_bytes == 0  # not copied from the given-back row
    assert bytes(row) == data


def test_a_lane_threads_commit_that_lands_first_makes_the_withdrawal_stop_nothing(store: ChunkStore) -> None:
    landings = RowLandings(on_landed=lambda: None)
    offer = landings.offer(_key(1), memoryview(bytearray(CHUNK)))
    res = LandingStore(store, landings).begin_write(_key(1))
    assert res is not None and offer is not None
    stops: list[str] = []
    data = os.urandom(CHUNK)
    res.receive_view(lambda: stops.append("stopped"))[:] = data
    finish = _commit_paused_at_the_row(res, offer, data)
    assert finish() is True and offer.landed and offer.checksum == chunk_checksum(data)
    landings.release([offer])  # landed before the job ended: nothing to stop
    assert stops == [] and offer.state is LandingState.LANDED and len(landings) == 0
