"""The NIXL data plane: a fetcher READs the holder's store slot straight into its own slot.

Why this shape (measured on a 2-core host, ``kv-offload bench transport``): copying a chunk
once, by the fetcher, is the least work any transport can do; NVIDIA NIXL (the data plane
vLLM's own P2P tier uses, UCX backend, host memory) does it as a one-sided READ from memory
the holder registered, so the holder's core does nothing per chunk. On one host UCX moves
the bytes by CMA (``process_vm_readv``, same PID namespace); with an RDMA device and
``UCX_TLS`` naming ``rc``/``dc`` the same READ is an RDMA read (nothing else changes);
otherwise (pods on one node without hostPID, or no RDMA across nodes) UCX falls back to
TCP, which is slower than the tcp transport.

Planes: requests travel on a TCP connection with the TCP transport's frames and
authentication (``tcp.server`` / ``tcp.client`` with hooks); the holder's memory is
given only to a connection that proved its session: a read-only view of the store file
mapped and registered for that connection alone, its partial NIXL metadata sealed under
the session key (``frames``, ``exports``). The view is revoked (deregistered, unmapped)
when the connection ends or its session is no longer authorised. A FETCH is answered with
CHUNK_AT (key, checksum, slot) per chunk, the chunk pinned under a lease until the fetcher
RELEASEs it; the fetcher's lanes (``runtime``: one thread and one NIXL agent each, as many
as the sidecar offers, ``--lanes``: one per core of its ``cpu_budget``, so its cores copy and hash
side by side) READ it as one transfer and hash the slot in one GIL-free call; the chunk becomes
visible only when the checksum matches the holder's. A chunk that changed after its lease
ran out fails that check and is never stored or handed to vLLM.

Modules: ``runtime`` (environment, lanes, agents), ``frames`` (CHUNK_AT, RELEASE, sealed
metadata), ``exports`` (per-connection views, leases), ``server``, ``client``.
Install: ``pip install --no-deps nixl-cu12==1.5.1`` (its declared torch requirement serves
GPU paths only).
"""
