"""The sidecar copies between vLLM's primary rows and its store: the region handed over as a
descriptor, rows bounded, deadlines kept, the mapping gone with the engine's connection."""

import functools
import json
import mmap
import os
import socket
import struct
import time

import pytest
from kv_offload_sidecar.engine.client import EngineClient, StoreCut
from kv_offload_sidecar.engine.region_file import find_region_file
from kv_offload_testing.local_pool import LocalPool, SidecarOverride
from primary_rows import PrimaryRows
from waiting import wait_for

SLOT = 16384
ROWS = 8
STRIDE = SLOT + mmap.PAGESIZE  # rows wider than a chunk, as vLLM pads them to pages


@pytest.fixture(scope="module")
def pool():
    with LocalPool(1, capacity_bytes=64 * SLOT) as p:
        yield p


# A primary region of ROWS rows of STRIDE bytes, SLOT-byte chunks.
Region = functools.partial(PrimaryRows, rows=ROWS, stride=STRIDE, chunk_bytes=SLOT)


def _keys(n):
    return [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]


def _client(pool, region):
    c = EngineClient.connect("127.0.0.1", pool[0].port, region=region.spec)
    assert c.region_attached, c.region_reason
    return c


def _copies(pool, op):
    return pool[0].metric("kv_offload_engine_transfer_seconds_count", op=op, phase="copy")


def test_the_sidecar_stores_rows_and_loads_them_into_other_rows_byte_identical(pool):
    region = Region()
    client = _client(pool, region)
    try:
        keys = _keys(2)
        data = [region.fill(1), region.fill(3)]
        stores, loads = _copies(pool, "store"), _copies(pool, "load")
        assert client.store_rows(keys, [1, 3], paced=True) == 2  # paced: the same bytes
        assert client.load_rows(keys, [5, 6]) == 2
        assert [region.chunk(5), region.chunk(6)] == data
        # Only the named rows' chunk bytes changed: padding and other rows keep their guard.
        untouched = [r for r in range(ROWS) if r not in (1, 3, 5, 6)]
        assert (region.rows[untouched] == 0xEE).all()
        assert (region.rows[[5, 6], SLOT:] == 0xEE).all()
        assert (_copies(pool, "store"), _copies(pool, "load")) == (stores + 1, loads + 1)
        # Stored keys are held: storing them again writes nothing.
        assert client.store_rows(keys, [1, 3]) == 0
    finally:
        client.close()


def test_a_row_outside_the_region_is_refused_before_any_byte_moves(pool):
    region = Region()
    client = _client(pool, region)
    try:
        keys = _keys(2)
        region.fill(0)
        before = region.rows.copy()
        assert client.store_rows(keys, [0, ROWS]) == 0
        assert pool[0].hits(keys) == 0
        client.store_rows(keys[:1], [0])
        assert client.load_rows(keys[:1], [-1]) == 0
        assert (region.rows == before).all()
    finally:
        client.close()


def _channel(pool):
    info = pool[0].client().info()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(info["socket"])
    return s


def _call(s, req, fds=()):
    data = json.dumps(req).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(s, [frame], list(fds))
    else:
        s.sendall(frame)
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return json.loads(body)


def _attach(pool, region):
    s = _channel(pool)
    fd = region.spec.file.fd
    reply = _call(s, {"op": "attach_region", "offset": 0, "row_stride": STRIDE, "num_rows": ROWS,
                      "chunk_bytes": SLOT}, [fd])
    assert reply["ok"], reply
    return s, reply["region"]


def test_nothing_is_read_or_written_past_a_jobs_deadline(pool):
    region = Region()
    keeper, rid = _attach(pool, region)
    s = _channel(pool)
    try:
        keys = _keys(1)
        region.fill(2)
        late = time.monotonic() - 1.0
        reply = _call(s, {"op": "store_rows", "region": rid, "keys": [keys[0].hex()], "rows": [2],
                          "deadline": late})
        assert reply == {"ok": True, "committed": 0, "cut": 1}  # reserved, never landed
        assert pool[0].hits(keys) == 0
        reply = _call(s, {"op": "store_rows", "region": rid, "keys": [keys[0].hex()], "rows": [2],
                          "deadline": time.monotonic() + 5})
        assert reply["committed"] == 1
        before = region.rows.copy()
        reply = _call(s, {"op": "load_rows", "region": rid, "keys": [keys[0].hex()], "rows": [4],
                          "deadline": late})
        assert reply == {"ok": True, "loaded": 0}
        assert (region.rows == before).all()
    finally:
        s.close()
        keeper.close()


def test_a_cancelled_store_lands_nothing_and_a_strict_one_is_not_reported_stored(pool):
    region = Region("cut")
    client = _client(pool, region)
    try:
        keys = _keys(2)
        region.fill(0), region.fill(1)
        assert client.cancel(["tier-a:s1"]) == 0  # before its request: remembered
        with pytest.raises(StoreCut) as cut:
            client.store_rows(keys, [0, 1], strict=True, job="tier-a:s1")
        assert cut.value.committed == 0
        assert pool[0].hits(keys) == 0
        # Not cancelled, it lands; stored again, the held keys are skipped, which is no cut.
        assert client.store_rows(keys, [0, 1], strict=True, job="tier-a:s2") == 2
        assert client.store_rows(keys, [0, 1], strict=True) == 0
        assert pool[0].hits(keys) == 2
    finally:
        client.close()


def test_a_load_cancelled_before_its_request_came_answers_at_once_and_writes_no_row(pool):
    region = Region("cancelled")
    client = _client(pool, region)
    s = _channel(pool)
    try:
        keys = _keys(2)
        region.fill(0), region.fill(1)
        assert client.store_rows(keys, [0, 1]) == 2
        before = region.rows.copy()
        # The cancel may overtake its job (another connection): the sidecar remembers it.
        assert client.cancel(["tier-a:7"]) == 0
        assert client.load_rows(keys, [4, 5], timeout=60.0, job="tier-a:7") == 0
        assert (region.rows == before).all()
        # Another id loads as usual.
        assert client.load_rows(keys, [4, 5], timeout=60.0, job="tier-a:8") == 2
        assert region.chunk(4) == region.chunk(0)
        for bad in ({"op": "cancel", "jobs": "tier-a:7"}, {"op": "cancel", "jobs": [7]},
                    {"op": "cancel", "jobs": ["x" * 65]}):
            assert _call(s, bad)["ok"] is False
    finally:
        s.close()
        client.close()


def _maps_region(pool, name):
    with open(f"/proc/{pool[0].proc.pid}/maps") as fh:
        return any(name in line for line in fh)


def test_the_region_is_unmapped_once_the_connection_that_attached_it_closes(pool):
    region = Region("unmapped")
    keeper, rid = _attach(pool, region)
    assert _maps_region(pool, "kv-offload-test-unmapped")
    keeper.close()
    s = _channel(pool)
    try:
        # The sidecar closes the connection's region before it answers anything new on it.
        def refused() -> dict | None:
            reply = _call(s, {"op": "load_rows", "region": rid, "keys": [_keys(1)[0].hex()],
                              "rows": [0], "deadline": time.monotonic() + 1})
            return None if reply["ok"] else reply

        reply = wait_for("the region forgotten with its connection", refused)
        assert reply["stale"] is True and "unknown region" in reply["error"]
        assert not _maps_region(pool, "kv-offload-test-unmapped")
    finally:
        s.close()


@pytest.mark.parametrize("req, phrase", [
    ({"op": "attach_region", "offset": 0, "row_stride": STRIDE, "num_rows": ROWS,
      "chunk_bytes": SLOT}, "first frame"),
    ({"op": "store_rows", "region": 12345, "keys": [], "rows": [], "deadline": 0}, "unknown region"),
    ({"op": "store_rows", "region": 12345, "keys": [], "rows": [], "deadline": 0, "paced": "yes"},
     "'paced' must be true or false, got 'yes'"),
])
def test_region_requests_without_a_region_are_answered_with_the_reason(pool, req, phrase):
    s = _channel(pool)
    try:
        _call(s, {"op": "info"})  # attach_region is only taken as a connection's first frame
        reply = _call(s, req)
        assert reply["ok"] is False and phrase in reply["error"]
    finally:
        s.close()


def test_a_region_larger_than_its_file_is_refused(pool):
    region = Region()
    s = _channel(pool)
    try:
        reply = _call(s, {"op": "attach_region", "offset": 0, "row_stride": STRIDE,
                          "num_rows": ROWS + 1, "chunk_bytes": SLOT}, [region.spec.file.fd])
        assert reply["ok"] is False and "its file has" in reply["error"]
    finally:
        s.close()


def test_an_anonymous_region_is_not_offered_and_the_client_says_why():
    found, reason = find_region_file(memoryview(bytearray(4096)))
    assert found is None and "anonymous" in reason


@pytest.fixture(scope="module")
def trio():
    """A holder (0), a pod that drops fetched chunks once loaded (1, the default) and one that
    keeps them at its cold end (2, ``--peer-copies cold``)."""
    cold = SidecarOverride(extra_args=("--peer-copies", "cold"), joins=True)
    with LocalPool(3, capacity_bytes=64 * SLOT, overrides={2: cold}) as p:
        p.wait_connected()
        yield p


def _into_rows(pool, i):
    return pool[i].metric("kv_offload_peer_chunks_into_rows_total")


@pytest.mark.parametrize("loader, lands_in_rows", [(1, True), (2, False)])
def test_a_peer_chunk_lands_straight_in_the_row_its_load_job_names_unless_copies_are_kept(
        trio, loader, lands_in_rows):
    holder_region, region = Region(f"holder-{loader}"), Region(f"loader-{loader}")
    holder, client = _client_of(trio, 0, holder_region), _client_of(trio, loader, region)
    try:
        keys = _keys(3)
        data = [holder_region.fill(r) for r in range(3)]
        assert holder.store_rows(keys, [0, 1, 2]) == 3
        wait_for("the holder's chunks visible to the loader", lambda: trio[loader].hits(keys) >= 3)
        into_rows, copies = _into_rows(trio, loader), trio[loader].metric(
            "kv_offload_engine_transfer_seconds_count", op="load", phase="copy")
        # No lookup first: the job offers its rows before the fetch starts.
        assert client.load_rows(keys, [5, 6, 7], timeout=10.0) == 3
        assert [region.chunk(r) for r in (5, 6, 7)] == data
        untouched = [r for r in range(ROWS) if r not in (5, 6, 7)]
        assert (region.rows[untouched] == 0xEE).all() and (region.rows[[5, 6, 7], SLOT:] == 0xEE).all()
        assert _into_rows(trio, loader) - into_rows == (3 if lands_in_rows else 0)
        assert trio[loader].metric("kv_offload_engine_transfer_seconds_count", op="load",
                                   phase="copy") == copies + 1
        # Landed in rows, the chunks were never stored at the loader; copied, they were
        # stored first and kept (cold) once loaded.
        assert trio[loader].held(keys)[0] == (0 if lands_in_rows else 3)
    finally:
        holder.close()
        client.close()


def _client_of(pool, i, region):
    c = EngineClient.connect("127.0.0.1", pool[i].port, region=region.spec)
    assert c.region_attached, c.region_reason
    return c
