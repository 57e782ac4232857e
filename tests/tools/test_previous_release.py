"""The last release's sidecar and this one's in one pool: chunks shared both ways, no refusal.

The recorded commit (``previous_release.LAST_RELEASE``) runs from a temporary git worktree,
removed afterwards; each sidecar has its stand-in engine (``pool.client``, this tree's client).
"""

from __future__ import annotations

import os

import pytest
from kv_offload_sidecar.engine.client import EngineClient, LookupReply
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION
from kv_offload_tools.local_pool import LocalPool, example_config
from kv_offload_operator.pools.pool_spec import SidecarSpec
from kv_offload_operator.webhook import pod_patch
from kv_offload_tools.previous_release import LAST_RELEASE_WIRE, checked_out, flags_refused, launcher

CHUNK = example_config().kv_bytes_per_chunk
HANDSHAKES = "kv_offload_handshakes_total"


def new_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + (0).to_bytes(4, "big") for _ in range(n)]


def write_chunks(client: EngineClient, keys: list[bytes]) -> dict[bytes, bytes]:
    data = {k: os.urandom(client.slot_bytes) for k in keys}
    assert client.store(keys, lambda i, view: view.__setitem__(slice(None), data[keys[i]])) == len(keys)
    return data


def read_chunks(client: EngineClient, keys: list[bytes]) -> list[bytes]:
    out: dict[int, bytes] = {}
    n = client.load(keys, lambda i, view: out.__setitem__(i, bytes(view)), 5.0)
    return [out[i] for i in range(n)]


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_the_last_release_and_this_one_share_chunks_both_ways_in_one_pool(transport):
    with checked_out() as release:
        with LocalPool(2, transport=transport, capacity_bytes=64 * CHUNK,
                       launcher=launcher(release, {"sidecar-0"})) as pool:
            previous, today = pool[0], pool[1]
            assert previous.status()["wire_version"] == LAST_RELEASE_WIRE
            assert today.status()["wire_version"] == WIRE_VERSION
            assert (today.status()["wire_min"], today.status()["wire_max"]) == (LAST_RELEASE_WIRE, WIRE_VERSION)
            # the releases a pool runs, from /metrics: the last release has no build_info series
            assert today.metric("kv_offload_build_info", wire=WIRE_VERSION) == 1
            assert previous.metric("kv_offload_build_info") == 0
            for holder, reader in ((0, 1), (1, 0)):
                keys = new_keys(4)
                data = write_chunks(pool.client(holder), keys)
                pool.wait_directory_current()
                client = pool.client(reader)
                assert client.lookup(keys) == LookupReply(local=0, peer=4), (holder, reader)
                assert read_chunks(client, keys) == [data[k] for k in keys]
            for member in (previous, today):
                assert member.metric(HANDSHAKES, result="rejected") == 0
                assert member.metric(HANDSHAKES, result="accepted") >= 1
            # this release speaks the last one's version to it
            assert [p.get("wire_version") for p in today.peers()] == [LAST_RELEASE_WIRE]
        assert os.path.isdir(release)
    assert not os.path.exists(release)


def test_the_last_releases_sidecar_accepts_every_flag_this_operator_injects():
    # a pool pinned to the last release's image (spec.sidecar.image) under this operator
    spec = SidecarSpec(image="kv-offload:previous", resources={}, capacity_bytes=1 << 30, transport="tcp",
                       base_port=5710, data_port=5810, shm_size_limit=None, tls_secret="pool-tls",
                       engine_metrics_url="http://127.0.0.1:8000/metrics")
    container = pod_patch.sidecar_container(pool_name="llama", namespace="ns1", sidecar=spec,
                                            dp_indices=(0, 1), shm_volume=pod_patch.SHM_VOLUME)
    assert container["args"][0] == "sidecar" and "--tls-ca-file" in container["args"]
    with checked_out() as release:
        assert flags_refused(release, container["args"]) is None
        assert "--no-such-flag" in flags_refused(release, [*container["args"], "--no-such-flag"])
