"""Sidecars and the tier's client work with more than 1,024 descriptors open (issue 48).

``select.select`` raises ``ValueError`` for a descriptor of 1,024 or more: a sidecar of a
large pool and vLLM's own process get there. Here every sidecar process and this test's
process (the tier's client: ``EngineClient``'s lookups through ``PendingLookup``) hold
``PAST_FD_SETSIZE`` descriptors, so every socket they open lands past 1,024, and a peer
fetch over TCP (its replies waited for by ``poll_readable``) and the tier's pending lookups
work as with few descriptors.
"""

from __future__ import annotations

import socket

from kv_offload_sidecar.engine.client import LookupReply
from kv_offload_testing.local_pool import LocalPool
from kv_offload_tools.many_descriptors import PAST_FD_SETSIZE, holding, launcher, open_descriptors
from sidecar_support import new_keys, read_chunks, write_chunks

CHUNK = 16384


def test_a_pool_whose_processes_hold_over_1024_descriptors_shares_chunks_as_usual():
    with holding(PAST_FD_SETSIZE), LocalPool(2, capacity_bytes=64 * CHUNK,
                                             launcher=launcher(PAST_FD_SETSIZE)) as pool:
        for sc in pool.sidecars:
            assert open_descriptors(sc.proc.pid) > 1024
        writer, reader = pool.client(0), pool.client(1)
        with socket.socket() as probe:  # every socket this process opens now lies past 1,024
            assert probe.fileno() >= 1024
        keys = new_keys(8)
        data = write_chunks(writer, keys)
        pool.wait_directory_current()
        pending = reader.lookup_start(keys, 5.0)
        assert pending.wait() == LookupReply(local=0, peer=8)
        assert read_chunks(reader, keys) == [data[k] for k in keys]
        assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") == 8 * CHUNK
        for sc in pool.sidecars:
            assert "Traceback" not in open(sc.log_path).read()
        writer.close()
        reader.close()
