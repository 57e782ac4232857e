"""ChunkStore: budgeted LRU slots in one shared-memory file, pins, reservations."""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import tracemalloc
from collections import OrderedDict
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_offload_sidecar.engine.store_view import ChunkStoreView, slot_stride_for
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.store.checksum import chunk_checksum
from kv_offload_sidecar.store.chunk_store import ChunkStore
from prometheus_client import CollectorRegistry

PAGE = mmap.PAGESIZE
# Not a page multiple on purpose: the stride rounds it up.
SLOT_BYTES = 3 * PAGE + 100
STRIDE = slot_stride_for(SLOT_BYTES)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory on the real /dev/shm tmpfs, removed after the test."""
    path = tempfile.mkdtemp(prefix="kvo-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def metrics() -> SidecarMetrics:
    return SidecarMetrics(CollectorRegistry())


def sample(metrics: SidecarMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def make_store(shm_dir: str, slots: int, **kwargs) -> ChunkStore:
    return ChunkStore(SLOT_BYTES, slots * STRIDE + PAGE - 1, directory=shm_dir, **kwargs)


def key(i: int) -> bytes:
    """A vLLM-shaped OffloadKey: 32-byte hash + 4-byte big-endian group index."""
    return i.to_bytes(32, "big") + (i % 3).to_bytes(4, "big")


def payload(i: int) -> bytes:
    """Deterministic chunk bytes for key(i); every byte depends on i."""
    return bytes([i % 251]) * (SLOT_BYTES - 8) + i.to_bytes(8, "big")


def write(store: ChunkStore, i: int) -> bool:
    res = store.begin_write(key(i))
    if res is None:
        return False
    res.view[:] = payload(i)
    return res.commit()


def test_committed_chunk_is_visible_with_its_bytes_and_checksum(shm_dir: str) -> None:
    with make_store(shm_dir, 4) as store:
        assert store.num_slots == 4 and store.slot_stride == STRIDE
        assert write(store, 1)
        assert store.contains(key(1)) and len(store) == 1
        assert store.checksum_of(key(1)) == chunk_checksum(payload(1))
        with store.pin(key(1)) as chunk:
            assert bytes(chunk.view) == payload(1)
            assert chunk.checksum == chunk_checksum(payload(1))
            assert len(chunk.view) == SLOT_BYTES
        assert store.pin(key(2)) is None
        assert store.checksum_of(key(2)) is None


def test_lookup_prefix_counts_only_leading_visible_keys(shm_dir: str) -> None:
    with make_store(shm_dir, 8) as store:
        for i in (0, 1, 2, 4):
            assert write(store, i)
        assert store.lookup_prefix([key(i) for i in range(6)]) == 3
        assert store.lookup_prefix([key(3), key(0)]) == 0
        assert store.lookup_prefix([]) == 0


def test_lookup_prefix_accepts_any_key_buffers_and_rejects_bad_keys_anywhere(shm_dir: str) -> None:
    with make_store(shm_dir, 8) as store:
        for i in range(3):
            assert write(store, i)
        assert store.lookup_prefix(iter([key(0), bytearray(key(1)), memoryview(key(2)), key(5)])) == 3
        assert store.lookup_prefix((key(0), key(1))) == 2
        # A bad key fails the whole call, even after the first miss.
        with pytest.raises(ValueError, match="key length 0"):
            store.lookup_prefix([key(0), key(9), b""])
        with pytest.raises(ValueError, match="key length 4097"):
            store.lookup_prefix([key(0), b"x" * 4097])
        with pytest.raises(TypeError, match="must be bytes, got str"):
            store.lookup_prefix([key(0), "k"])  # type: ignore[list-item]


def resident_bytes_of_mapping(path: str) -> int:
    """Rss of this process's mapping of ``path``, from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if line.rstrip().endswith(" " + path):
                found = True
            elif found and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{path} is not mapped")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_new_store_is_prefaulted_so_first_writes_take_no_page_faults(shm_dir: str) -> None:
    with make_store(shm_dir, 64) as store:
        # Every page is mapped into this process already, before any chunk was written.
        assert resident_bytes_of_mapping(store.path) == 64 * STRIDE


def test_full_store_evicts_least_recently_used_chunk_first(shm_dir: str) -> None:
    changes: list[tuple[bytes, bool]] = []
    with make_store(shm_dir, 3, on_change=lambda k, present: changes.append((k, present))) as store:
        for i in range(3):
            assert write(store, i)
        # Touch 0 so that 1 becomes the least recently used.
        assert store.lookup_prefix([key(0)]) == 1
        assert write(store, 3)
        assert store.keys() == [key(2), key(0), key(3)]
        assert (key(1), False) in changes
        # Reading through a pin also counts as a use.
        store.pin(key(2)).release()
        assert write(store, 4)
        assert store.keys() == [key(3), key(2), key(4)]
        assert store.stats()["evictions"] == 2


def test_lookup_prefix_keeps_the_prefix_head_longest(shm_dir: str) -> None:
    with make_store(shm_dir, 3) as store:
        for i in range(3):
            assert write(store, i)
        assert store.lookup_prefix([key(0), key(1), key(2)]) == 3
        assert write(store, 10)
        # The tail of the prefix goes first: its head is useless without it.
        assert not store.contains(key(2))
        assert store.contains(key(0)) and store.contains(key(1))


def test_budget_is_never_exceeded_under_writes_ten_times_capacity(
    shm_dir: str, metrics: SidecarMetrics
) -> None:
    capacity = 5 * STRIDE + STRIDE // 2
    with ChunkStore(SLOT_BYTES, capacity, directory=shm_dir, metrics=metrics) as store:
        assert os.path.getsize(store.path) == 5 * STRIDE <= capacity
        assert sample(metrics, "kv_offload_store_capacity_bytes") == 5 * STRIDE
        for i in range(50):
            assert write(store, i)
            assert store.used_bytes <= capacity
            assert len(store) <= store.num_slots
            assert sample(metrics, "kv_offload_store_used_bytes") <= capacity
        assert store.keys() == [key(i) for i in range(45, 50)]
        assert sample(metrics, "kv_offload_evictions_total") == 45
        assert sample(metrics, "kv_offload_store_chunks") == 5
        for i in range(45, 50):
            with store.pin(key(i)) as chunk:
                assert bytes(chunk.view) == payload(i)
        assert os.path.getsize(store.path) == 5 * STRIDE


def test_concurrent_writers_and_readers_keep_budget_and_never_tear_a_chunk(shm_dir: str) -> None:
    store = make_store(shm_dir, 6)
    errors: list[str] = []
    stop = threading.Event()

    def writer(base: int) -> None:
        for n in range(400):
            i = base + n
            res = store.begin_write(key(i))
            if res is None:
                continue
            data = payload(i)
            half = len(data) // 2
            res.view[:half] = data[:half]
            os.sched_yield()
            res.view[half:] = data[half:]
            if not res.commit():
                errors.append(f"commit of {i} failed")

    def reader() -> None:
        while not stop.is_set():
            for k in store.keys():
                chunk = store.pin(k)
                if chunk is None:
                    continue
                with chunk:
                    i = int.from_bytes(k[:32], "big")
                    first = bytes(chunk.view[:SLOT_BYTES // 2])
                    os.sched_yield()
                    if first + bytes(chunk.view[SLOT_BYTES // 2 :]) != payload(i):
                        errors.append(f"chunk {i} changed while pinned")
                    if chunk_checksum(chunk.view) != chunk.checksum:
                        errors.append(f"chunk {i} does not match its checksum")

    def auditor() -> None:
        while not stop.is_set():
            s = store.stats()
            if s["used_bytes"] > store.capacity_bytes:
                errors.append(f"used_bytes {s['used_bytes']} above budget")
            if s["chunks"] + s["writing"] + s["free_slots"] != store.num_slots:
                errors.append(f"slot accounting broken: {s}")

    writers = [threading.Thread(target=writer, args=(b * 10_000,)) for b in range(4)]
    others = [threading.Thread(target=reader) for _ in range(2)] + [threading.Thread(target=auditor)]
    try:
        for t in writers + others:
            t.start()
        for t in writers:
            t.join(timeout=50)
        stop.set()
        for t in others:
            t.join(timeout=10)
        assert not errors, errors[:5]
        s = store.stats()
        assert s["writing"] == 0 and s["pinned"] == 0
        assert s["chunks"] == store.num_slots
        assert s["evictions"] > 1000
    finally:
        stop.set()
        store.close()


def test_pinned_chunk_survives_eviction_pressure_with_its_bytes_intact(shm_dir: str) -> None:
    with make_store(shm_dir, 3) as store:
        assert write(store, 7)
        chunk = store.pin(key(7))
        assert chunk is not None
        for i in range(100, 130):
            assert write(store, i)
        assert store.contains(key(7))
        assert bytes(chunk.view) == payload(7)
        chunk.release()
        for i in range(200, 203):
            assert write(store, i)
        assert not store.contains(key(7))


def test_chunk_pinned_twice_stays_pinned_until_both_handles_release(shm_dir: str) -> None:
    with make_store(shm_dir, 2) as store:
        assert write(store, 1)
        first, second = store.pin(key(1)), store.pin(key(1))
        first.release()
        first.release()  # idempotent: must not drop the other handle's pin
        for i in range(10, 15):
            assert write(store, i)
        assert store.contains(key(1)) and bytes(second.view) == payload(1)
        assert store.stats()["pinned"] == 1
        second.release()
        assert store.stats()["pinned"] == 0
        assert write(store, 20) and write(store, 21)
        assert not store.contains(key(1))


def test_begin_write_returns_none_when_every_slot_is_pinned_or_reserved(shm_dir: str) -> None:
    with make_store(shm_dir, 2) as store:
        assert write(store, 1)
        pinned = store.pin(key(1))
        reserved = store.begin_write(key(2))
        assert reserved is not None
        assert store.begin_write(key(3)) is None
        assert store.used_bytes == 2 * STRIDE
        reserved.abort()
        second = store.begin_write(key(3))
        assert second is not None
        assert store.begin_write(key(4)) is None
        second.abort()
        pinned.release()
        assert store.contains(key(1))


def test_begin_write_refuses_a_key_that_is_visible_or_being_written(shm_dir: str) -> None:
    with make_store(shm_dir, 4) as store:
        assert write(store, 1)
        assert store.begin_write(key(1)) is None
        res = store.begin_write(key(2))
        assert store.begin_write(key(2)) is None
        res.abort()
        assert store.begin_write(key(2)) is not None


def test_aborted_or_abandoned_reservation_frees_its_slot_and_stays_invisible(shm_dir: str) -> None:
    with make_store(shm_dir, 1) as store:
        res = store.begin_write(key(1))
        res.view[:] = payload(1)
        assert not store.contains(key(1)) and len(store) == 0
        res.abort()
        res.abort()
        assert not res.commit()
        assert store.used_bytes == 0 and not store.contains(key(1))
        with pytest.raises(RuntimeError, match="boom"):
            with store.begin_write(key(2)) as res2:
                res2.view[:10] = b"x" * 10
                raise RuntimeError("boom")
        assert store.used_bytes == 0 and store.keys() == []
        with store.begin_write(key(3)) as res3:
            res3.view[:] = payload(3)
            assert res3.commit()
        assert store.keys() == [key(3)]


def test_reservation_view_is_released_after_commit(shm_dir: str) -> None:
    with make_store(shm_dir, 2) as store:
        res = store.begin_write(key(1))
        res.view[:] = payload(1)
        assert res.commit()
        with pytest.raises(ValueError):
            res.view[0] = 1
        with store.pin(key(1)) as chunk:
            pass
        with pytest.raises(ValueError):
            bytes(chunk.view)
        assert store.pin(key(1)) is not None


def test_received_chunk_with_matching_checksum_becomes_visible(shm_dir: str) -> None:
    with make_store(shm_dir, 2) as store:
        res = store.begin_write(key(5))
        res.view[:] = payload(5)
        assert res.commit(chunk_checksum(payload(5)))
        assert store.checksum_of(key(5)) == chunk_checksum(payload(5))


def test_checksum_mismatch_drops_the_chunk_and_counts_an_integrity_failure(
    shm_dir: str, metrics: SidecarMetrics
) -> None:
    changes: list[tuple[bytes, bool]] = []
    with make_store(shm_dir, 2, metrics=metrics, on_change=lambda k, p: changes.append((k, p))) as store:
        res = store.begin_write(key(5))
        res.view[:] = payload(5)
        res.view[100] ^= 0xFF  # corrupted in flight
        assert not res.commit(chunk_checksum(payload(5)))
        assert not store.contains(key(5))
        assert store.used_bytes == 0 and sample(metrics, "kv_offload_store_used_bytes") == 0
        assert sample(metrics, "kv_offload_integrity_failures_total") == 1
        assert store.stats()["integrity_failures"] == 1
        assert changes == []
        # The key can be fetched again.
        assert write(store, 5)


def test_on_change_runs_outside_the_lock_and_a_failing_callback_breaks_nothing(
    shm_dir: str,
) -> None:
    seen: list[tuple[bytes, bool, int]] = []

    def on_change(k: bytes, present: bool) -> None:
        # Calling back into the store would deadlock if the lock were held.
        seen.append((k, present, len(store)))
        raise RuntimeError("callback bug")

    store = make_store(shm_dir, 1, on_change=on_change)
    with store:
        assert write(store, 1)
        assert write(store, 2)
        assert seen == [(key(1), True, 1), (key(1), False, 0), (key(2), True, 1)]
        assert store.keys() == [key(2)]


def in_an_engine_process(store: ChunkStore, code: str, *args: object, blocked: tuple[str, ...] = ()) -> str:
    """The output of ``code`` run by another Python process (an engine in miniature) that first
    attached ``store``'s file as ``view``, a ChunkStoreView: ``path`` is the file, ``args`` are
    ``sys.argv[1:]``, and the modules ``blocked`` cannot be imported there."""
    attach = (f"import sys\n"
              f"for blocked in {blocked!r}:\n"
              f"    sys.modules[blocked] = None\n"
              f"from kv_offload_sidecar.engine.store_view import ChunkStoreView\n"
              f"path = {store.path!r}\n"
              f"view = ChunkStoreView.attach(path, {SLOT_BYTES}, {store.num_slots})\n")
    done = subprocess.run([sys.executable, "-c", attach + code, *map(str, args)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_second_process_attaches_and_shares_slot_bytes_without_a_socket(shm_dir: str) -> None:
    with make_store(shm_dir, 4, name="attach-test") as store:
        assert write(store, 3)
        chunk = store.pin(key(3))
        code = (
            "from kv_offload_sidecar.store.checksum import chunk_checksum\n"
            "slot, target = map(int, sys.argv[1:])\n"
            "print(chunk_checksum(view.slot_view(slot)))\n"
            "v = view.slot_view(target)\n"
            "v[:] = bytes(v)[::-1]\n"
        )
        res = store.begin_write(key(4))
        res.view[:] = payload(4)[::-1]
        out = in_an_engine_process(store, code, chunk.slot, res.slot)
        assert int(out) == chunk.checksum == chunk_checksum(payload(3))
        # The other process wrote the reservation's slot in place.
        assert res.commit(chunk_checksum(payload(4)))
        chunk.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_engine_view_maps_every_page_at_attach_and_leaves_the_chunks_intact(shm_dir: str) -> None:
    with make_store(shm_dir, 64, name="view-populate") as store:
        for i in range(64):
            assert write(store, i)
        slots = {store.pin(key(i)).slot: i for i in range(64)}  # pins keep the slots put
        code = (
            "from kv_offload_sidecar.store.checksum import chunk_checksum\n"
            "rss, found = None, False\n"
            "for line in open('/proc/self/smaps'):\n"
            "    if line.rstrip().endswith(' ' + path):\n"
            "        found = True\n"
            "    elif found and line.startswith('Rss:'):\n"
            "        rss = int(line.split()[1]) * 1024\n"
            "        break\n"
            "print(rss)\n"
            "print(' '.join(str(chunk_checksum(view.slot_view(s))) for s in range(view.num_slots)))\n"
        )
        out = in_an_engine_process(store, code).split("\n")
        # Mapped at attach, before the engine read a byte.
        assert int(out[0]) == 64 * STRIDE
        checksums = [int(c) for c in out[1].split()]
        assert all(checksums[slot] == chunk_checksum(payload(i)) for slot, i in slots.items())


def test_engine_view_rejects_missing_or_short_files_and_bad_geometry(shm_dir: str) -> None:
    with pytest.raises(ValueError, match="cannot open chunk store file"):
        ChunkStoreView.attach(os.path.join(shm_dir, "missing.slots"), SLOT_BYTES, 2)
    with make_store(shm_dir, 2) as store:
        with pytest.raises(ValueError, match="num_slots=3"):
            ChunkStoreView.attach(store.path, SLOT_BYTES, 3)
        with pytest.raises(ValueError, match="slot_bytes=0"):
            ChunkStoreView.attach(store.path, 0, 2)
        with pytest.raises(ValueError, match="slot_stride=100"):
            ChunkStoreView.attach(store.path, SLOT_BYTES, 2, slot_stride=100)
        with ChunkStoreView.attach(store.path, SLOT_BYTES, 2) as view:
            with pytest.raises(IndexError, match="slot=2"):
                view.slot_view(2)


def test_store_file_is_private_and_close_unlinks_it(shm_dir: str) -> None:
    store = make_store(shm_dir, 2, name="private")
    assert store.path == os.path.join(shm_dir, "kv-offload-private.slots")
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert write(store, 1)
    held = store.slot_view(0)
    store.close()
    store.close()
    assert not os.path.exists(store.path)
    assert store.closed
    with pytest.raises(RuntimeError, match="is closed"):
        store.begin_write(key(2))
    with pytest.raises(RuntimeError, match="is closed"):
        store.pin(key(1))
    assert len(store) == 0 and not store.contains(key(1))
    held.release()


def test_reservation_committed_after_close_is_not_visible(shm_dir: str) -> None:
    store = make_store(shm_dir, 2)
    res = store.begin_write(key(1))
    res.view[:] = payload(1)
    store.close()
    assert not res.commit()
    assert store.keys() == []


def test_existing_store_file_is_refused_unless_replace_existing(shm_dir: str) -> None:
    with make_store(shm_dir, 1, name="dup"):
        with pytest.raises(FileExistsError, match="replace_existing=True"):
            make_store(shm_dir, 1, name="dup")
    stale = os.path.join(shm_dir, "kv-offload-stale.slots")
    with open(stale, "wb") as f:
        f.write(b"left over")
    with make_store(shm_dir, 2, name="stale", replace_existing=True) as store:
        assert os.path.getsize(stale) == 2 * STRIDE
        assert write(store, 1)


@pytest.mark.parametrize(
    ("slot_bytes", "capacity", "match"),
    [
        (0, 1 << 20, "slot_bytes=0 must be a positive integer"),
        (-5, 1 << 20, "slot_bytes=-5"),
        (1.5, 1 << 20, "slot_bytes=1.5"),
        (PAGE, PAGE - 1, f"capacity_bytes={PAGE - 1} holds no chunk slot.*raise capacity_bytes to at least {PAGE}"),
        (PAGE + 1, 2 * PAGE - 1, f"raise capacity_bytes to at least {2 * PAGE}"),
        (PAGE, "1GiB", "capacity_bytes='1GiB'"),
    ],
)
def test_invalid_geometry_raises_value_error_naming_the_parameter(
    shm_dir: str, slot_bytes: object, capacity: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ChunkStore(slot_bytes, capacity, directory=shm_dir)  # type: ignore[arg-type]
    assert os.listdir(shm_dir) == []


def test_bad_directory_name_and_keys_raise_clear_errors(shm_dir: str) -> None:
    with pytest.raises(ValueError, match="directory='/nonexistent/kvo'"):
        ChunkStore(PAGE, PAGE, directory="/nonexistent/kvo")
    with pytest.raises(ValueError, match=r"name='\.\./x'"):
        ChunkStore(PAGE, PAGE, directory=shm_dir, name="../x")
    with make_store(shm_dir, 1) as store:
        with pytest.raises(ValueError, match="key length 0"):
            store.begin_write(b"")
        with pytest.raises(ValueError, match="key length 4097"):
            store.contains(b"k" * 4097)
        with pytest.raises(TypeError, match="must be bytes, got str"):
            store.pin("abc")  # type: ignore[arg-type]
        with pytest.raises(IndexError, match="slot=1"):
            store.slot_view(1)
        assert store.begin_write(b"k" * 4096) is not None


def test_commit_checksums_a_large_slot_in_place(shm_dir: str) -> None:
    slot_bytes = 16 << 20
    with ChunkStore(slot_bytes, slot_bytes, directory=shm_dir) as store:
        res = store.begin_write(key(1))
        res.view[-8:] = b"lastbyte"
        expected = chunk_checksum(res.view)
        tracemalloc.start()
        try:
            assert res.commit(expected)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < (1 << 20), f"commit allocated {peak} bytes: the slot was copied"


def test_engine_side_view_imports_without_xxhash_or_prometheus(shm_dir: str) -> None:
    """Inside vLLM only the standard library is guaranteed: ChunkStoreView must not need more."""
    with make_store(shm_dir, 2) as store:
        assert write(store, 9)
        slot = store.pin(key(9))
        code = "sys.stdout.write(bytes(view.slot_view(int(sys.argv[1]))[-8:]).hex())\n"
        out = in_an_engine_process(store, code, slot.slot,
                                   blocked=("xxhash", "prometheus_client", "numpy", "aiohttp"))
        slot.release()
        assert bytes.fromhex(out) == payload(9)[-8:]


class ChunkStoreAgainstModel(RuleBasedStateMachine):
    """Random sequences of writes, pins, lookups and reservations follow a plain LRU model."""

    SLOTS = 3

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvo-model-", dir="/dev/shm")
        self.store = make_store(self.dir, self.SLOTS)
        # Visible keys, least recently used first -> number of pins.
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.pending: dict[bytes, object] = {}
        self.pins: list[tuple[object, int]] = []

    def _free_slots(self) -> int:
        return self.SLOTS - len(self.lru) - len(self.pending)

    def _expect_reservation(self, k: bytes) -> bool:
        if k in self.lru or k in self.pending:
            return False
        if self._free_slots() > 0:
            return True
        for victim, pins in self.lru.items():
            if pins == 0:
                del self.lru[victim]
                return True
        return False

    @rule(i=st.integers(0, 7), verify=st.booleans(), corrupt=st.booleans())
    def write_chunk(self, i: int, verify: bool, corrupt: bool) -> None:
        k = key(i)
        expected = self._expect_reservation(k)
        res = self.store.begin_write(k)
        assert (res is not None) == expected
        if res is None:
            return
        res.view[:] = payload(i)
        if corrupt:
            assert not res.commit(chunk_checksum(payload(i)) ^ 1)
        else:
            assert res.commit(chunk_checksum(payload(i)) if verify else None)
            self.lru[k] = 0

    @rule(i=st.integers(0, 7))
    def begin_pending_write(self, i: int) -> None:
        k = key(i)
        expected = self._expect_reservation(k)
        res = self.store.begin_write(k)
        assert (res is not None) == expected
        if res is not None:
            res.view[:] = payload(i)
            self.pending[k] = res

    @rule(data=st.data(), commit=st.booleans())
    def finish_pending_write(self, data: st.DataObject, commit: bool) -> None:
        if not self.pending:
            return
        k = data.draw(st.sampled_from(sorted(self.pending)))
        res = self.pending.pop(k)
        if commit:
            assert res.commit()
            self.lru[k] = 0
        else:
            res.abort()

    @rule(i=st.integers(0, 7))
    def pin_chunk(self, i: int) -> None:
        k = key(i)
        chunk = self.store.pin(k)
        assert (chunk is not None) == (k in self.lru)
        if chunk is not None:
            self.lru[k] += 1
            self.lru.move_to_end(k)
            self.pins.append((chunk, i))

    @rule(data=st.data())
    def release_pin(self, data: st.DataObject) -> None:
        if not self.pins:
            return
        chunk, i = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        assert bytes(chunk.view) == payload(i)
        chunk.release()
        self.lru[key(i)] -= 1

    @rule(data=st.data(), ids=st.lists(st.integers(0, 7), max_size=4))
    def lookup(self, data: st.DataObject, ids: list[int]) -> None:
        # Lead with visible keys in a random order so prefixes of several hits occur.
        keys = data.draw(st.permutations(list(self.lru))) + [key(i) for i in ids]
        hits = 0
        while hits < len(keys) and keys[hits] in self.lru:
            hits += 1
        assert self.store.lookup_prefix(keys) == hits
        for k in reversed(keys[:hits]):
            self.lru.move_to_end(k)

    @invariant()
    def store_matches_model(self) -> None:
        assert self.store.keys() == list(self.lru)
        used = (len(self.lru) + len(self.pending)) * STRIDE
        assert self.store.used_bytes == used <= self.store.capacity_bytes
        for chunk, i in self.pins:
            assert chunk.checksum == chunk_checksum(payload(i))

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


ChunkStoreAgainstModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_chunk_store_follows_the_lru_model = ChunkStoreAgainstModel.TestCase


def test_dropped_reservation_and_pin_are_reclaimed_after_garbage_collection(shm_dir: str) -> None:
    import gc

    with make_store(shm_dir, 1) as store:
        res = store.begin_write(key(1))
        assert store.begin_write(key(2)) is None
        del res
        gc.collect()
        assert store.used_bytes == 0
        assert write(store, 2)
        chunk = store.pin(key(2))
        assert store.begin_write(key(3)) is None
        del chunk
        gc.collect()
        assert write(store, 3)
        assert store.keys() == [key(3)]


def test_unclosed_store_file_is_unlinked_when_the_store_is_collected(shm_dir: str) -> None:
    import gc

    store = make_store(shm_dir, 1, name="forgotten")
    path = store.path
    assert os.path.exists(path)
    del store
    gc.collect()
    assert not os.path.exists(path)


def test_close_without_unlink_leaves_the_file_for_attached_clients(shm_dir: str) -> None:
    store = make_store(shm_dir, 1, name="kept")
    assert write(store, 1)
    store.close(unlink=False)
    assert os.path.getsize(store.path) == STRIDE
    with ChunkStoreView.attach(store.path, SLOT_BYTES, 1) as view:
        slot = view.slot_view(0)
        assert bytes(slot) == payload(1)
        slot.release()


def test_engine_view_closed_while_a_slot_view_is_held_keeps_that_view_readable(shm_dir: str) -> None:
    with make_store(shm_dir, 1) as store:
        assert write(store, 1)
        view = ChunkStoreView.attach(store.path, SLOT_BYTES, 1)
        held = view.slot_view(0)
        view.close()  # the mapping goes with the held view, not before
        assert bytes(held) == payload(1)
        held.release()


def test_commit_after_the_caller_released_the_view_frees_the_slot(shm_dir: str) -> None:
    with make_store(shm_dir, 1) as store:
        res = store.begin_write(key(1))
        res.view[:] = payload(1)
        res.view.release()
        assert not res.commit()
        assert not store.contains(key(1)) and store.used_bytes == 0
        assert write(store, 1)


def commit_letters(store: ChunkStore, *letters: bytes) -> None:
    """Write and commit one 4 KiB chunk per one-letter key, filled with its letter."""
    for letter in letters:
        with store.begin_write(letter) as res:
            res.view[:] = letter * 4096
            assert res.commit()


def test_demoted_chunks_are_evicted_before_older_ones(tmp_path):
    store = ChunkStore(4096, 3 * 4096, directory=str(tmp_path), name="demote")
    try:
        commit_letters(store, *(b"a", b"b", b"c"))
        assert store.demote([b"c", b"zz"]) == 1
        commit_letters(store, b"d")
        assert not store.contains(b"c")
        assert all(store.contains(k) for k in (b"a", b"b", b"d"))
    finally:
        store.close()


def test_a_chunk_dropped_when_released_goes_at_its_last_release_and_frees_its_slot(tmp_path):
    changes: list[tuple[bytes, bool]] = []
    store = ChunkStore(4096, 2 * 4096, directory=str(tmp_path), name="transient",
                       on_change=lambda k, present: changes.append((k, present)))
    try:
        commit_letters(store, *(b"a", b"b"))
        first, second = store.pin(b"a"), store.pin(b"a")
        assert store.drop_when_released([b"a", b"b", b"zz"]) == 2
        # b was not pinned: gone at once; a stays while pinned, and is readable.
        assert not store.contains(b"b") and store.contains(b"a")
        assert changes[-1] == (b"b", False)
        first.release()
        assert store.contains(b"a") and bytes(second.view[:4]) == b"aaaa"
        second.release()
        assert not store.contains(b"a") and changes[-1] == (b"a", False)
        assert store.stats()["free_slots"] == 2 and store.stats()["evictions"] == 0
    finally:
        store.close()


def test_a_chunk_kept_by_the_store_is_not_dropped_by_a_later_release(tmp_path):
    store = ChunkStore(4096, 2 * 4096, directory=str(tmp_path), name="kept")
    try:
        commit_letters(store, b"a")
        pin = store.pin(b"a")
        pin.release()
        assert store.contains(b"a")
    finally:
        store.close()


def test_a_count_without_touch_leaves_the_lru_order_alone(tmp_path):
    store = ChunkStore(4096, 3 * 4096, directory=str(tmp_path), name="count")
    try:
        commit_letters(store, *(b"a", b"b", b"c"))
        assert store.lookup_prefix([b"a", b"b"], touch=False) == 2
        assert store.keys() == [b"a", b"b", b"c"]
        assert store.lookup_prefix([b"a", b"b"]) == 2
        assert store.keys() == [b"c", b"b", b"a"]
    finally:
        store.close()
