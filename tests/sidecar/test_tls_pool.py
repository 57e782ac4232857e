"""Two sidecar processes with the TLS data plane: chunks move byte-identical over tls:// addresses."""

from __future__ import annotations

from kv_offload_testing.certs import pool_certificates
from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, share_through_pool
from kv_offload_testing.local_pool import LocalPool, SidecarOverride


def test_a_tls_pool_shares_chunks_and_a_plain_pod_gets_none(tmp_path):
    files = pool_certificates(tmp_path, ["pool"])["pool"]  # one certificate for the whole pool
    tls = ("--tls-cert-file", files.cert_file, "--tls-key-file", files.key_file, "--tls-ca-file", files.ca_file)
    with LocalPool(2, extra_args=tls) as pool:
        chunk = pool.chunk_bytes
        assert all(sc.status()["data_address"].startswith("tls://") for sc in pool.sidecars)
        keys = chunk_keys("tls", 6)
        assert share_through_pool(pool, keys, chunk) == (6, 0)
        assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") >= 6 * chunk
        # a pod of the same pool without TLS never receives a byte over plain TCP
        plain = pool.add(SidecarOverride(extra_args=("--tls-cert-file", "", "--tls-key-file", "",
                                                     "--tls-ca-file", "")),
                         identity="plain", peers=[pool[0].identity], wait_connected=False)
        with plain.client() as c:
            assert load_and_verify(c, keys, chunk) == (0, 0)
        assert plain.metric("kv_offload_peer_bytes_total", direction="received") == 0
        assert all(p["state"] != "connected" for p in plain.peers())
