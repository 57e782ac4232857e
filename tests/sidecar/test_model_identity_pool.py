"""Real sidecar processes share only under their engines' model identity (issue 47).

A sidecar shares nothing before its engine stated its identity; sidecars whose engines
run other weights under the same fingerprint refuse each other (``model_mismatch``,
counted and logged with the field diff) and exchange no byte, while pods of one identity
go on sharing (a rolling update to other weights). The real-vLLM proof, with engines whose
command line and config.json are equal and whose weights differ, is in
tests/vllm/test_real_vllm_engines.py.
"""

from __future__ import annotations

from kv_offload_sidecar.engine.client import EngineClient, LookupReply
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.peers.handshake import HandshakeInitiator
from kv_offload_testing.local_pool import LocalPool, SidecarOverride
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY
from sidecar_support import new_keys, read_chunks, write_chunks
from waiting import wait_for

CHUNK = 16384
RETRAINED = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "weights": "files:9c1d000000000000"})


def test_a_sidecar_shares_nothing_until_its_engine_states_the_model_identity():
    with LocalPool(2, capacity_bytes=64 * CHUNK, model_identity=None) as pool:
        for sc in pool.sidecars:
            assert sc.peers() == []  # it dials nobody
            assert sc.status()["model_identity"] is None
            assert sc.metric("kv_offload_config_info", model_identity="") == 1
        # A peer's handshake is told to wait (503), not refused: nothing counts as a rejection.
        code, reply = pool[0].post("/v1/handshake",
                                   HandshakeInitiator(pool.pool_key, pool.local_hello()).step1())
        assert code == 503 and "engine has not stated its model identity" in reply["error"]
        assert pool[0].metric("kv_offload_handshakes_total", result="rejected") == 0
        engines = [EngineClient.connect(sc.host, sc.port, states=STAND_IN_IDENTITY.statement())
                   for sc in pool.sidecars]
        pool.wait_connected()
        keys = new_keys(4)
        data = write_chunks(engines[0], keys)
        pool.wait_directory_current()
        assert engines[1].lookup(keys) == LookupReply(local=0, peer=4)
        assert read_chunks(engines[1], keys) == [data[k] for k in keys]
        assert pool[1].status()["model_identity"]["digest"] == STAND_IN_IDENTITY.digest
        assert pool[1].metric("kv_offload_config_info",
                              model_identity=STAND_IN_IDENTITY.digest) == 1
        for e in engines:
            e.close()


def test_pods_of_other_weights_refuse_each_other_and_pods_of_one_kind_go_on_sharing():
    with LocalPool(2, capacity_bytes=64 * CHUNK) as pool:
        new = pool.add(SidecarOverride(model_identity=RETRAINED), wait_connected=False)
        newer = pool.add(SidecarOverride(model_identity=RETRAINED, joins=True),
                         peers=[new.identity], wait_connected=False)
        wait_for("the old pods to refuse the new one for its weights",
                 lambda: all(sc.metric("kv_offload_handshakes_total", result="rejected",
                                       reason="model_mismatch") >= 1 for sc in pool.sidecars[:2]))
        wait_for("the two new pods to share with each other",
                 lambda: any(p["state"] == "connected" for p in newer.peers()))
        old_engine, new_engine, newer_engine = pool.client(0), new.client(), newer.client()
        old_keys, new_keys_ = new_keys(4), new_keys(4)
        old_data = write_chunks(old_engine, old_keys)
        new_data = write_chunks(new_engine, new_keys_)
        pool.wait_directory_current()
        # Old weights' chunks reach old pods only, new weights' chunks new pods only.
        assert pool.client(1).lookup(old_keys) == LookupReply(local=0, peer=4)
        assert read_chunks(pool.client(1), old_keys) == [old_data[k] for k in old_keys]
        assert newer_engine.lookup(old_keys) == LookupReply(local=0, peer=0)
        wait_for("the newer pod to find the new pod's chunks",
                 lambda: newer_engine.lookup(new_keys_).peer == 4)
        assert read_chunks(newer_engine, new_keys_) == [new_data[k] for k in new_keys_]
        assert pool.client(1).lookup(new_keys_) == LookupReply(local=0, peer=0)
        for sc in (new, newer):
            assert sc.metric("kv_offload_peer_bytes_total", direction="received") <= 4 * CHUNK
        assert new.metric("kv_offload_peer_bytes_total", direction="received") == 0
        assert pool[0].metric("kv_offload_peer_bytes_total", direction="sent") == 4 * CHUNK
        log = open(pool[0].log_path).read()
        assert f"weights: {STAND_IN_IDENTITY.weights} != {RETRAINED.weights}" in log \
            or f"weights: {RETRAINED.weights} != {STAND_IN_IDENTITY.weights}" in log


def test_an_engine_of_other_weights_is_refused_by_a_sidecar_that_serves_another_identity():
    with LocalPool(1, capacity_bytes=64 * CHUNK) as pool:
        sc = pool[0]
        before = sc.metric("kv_offload_engine_refusals_total")
        other = EngineClient.connect(sc.host, sc.port, states=RETRAINED.statement())
        assert "another model identity" in other.info()["model_identity_refused"]
        assert sc.metric("kv_offload_engine_refusals_total") == before + 2  # connect, info()
        assert sc.status()["model_identity"]["digest"] == STAND_IN_IDENTITY.digest
        other.close()


def test_an_engine_contradicting_the_configmaps_declared_identity_is_refused_and_shares_nothing():
    with LocalPool(1, capacity_bytes=64 * CHUNK, model_identity=None,
                   declared_identity={"revision": "abc123"}) as pool:
        sc = pool[0]
        engine = EngineClient.connect(sc.host, sc.port, states=STAND_IN_IDENTITY.statement())
        refused = engine.info()["model_identity_refused"]
        assert "contradicts the pool's ConfigMap (revision: <none> != abc123)" in refused
        assert sc.status()["model_identity"] is None  # nothing adopted: it shares nothing
        assert sc.status()["declared_model_identity"] == {"revision": "abc123"}
        engine.close()
        declared = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "revision": "abc123"})
        with EngineClient.connect(sc.host, sc.port, states=declared.statement()) as ok:
            assert ok.info()["model_identity_refused"] == ""
        assert sc.status()["model_identity"]["revision"] == "abc123"
