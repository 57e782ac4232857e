"""The UCX data plane: ``ucxx`` tag messages between worker addresses.

Why this shape:
UCX's shared-memory transports (``UCX_TLS=sm``, CMA rendezvous) only work with
peer error handling off, and ucxx's listener (sockaddr) path refuses them, so
endpoints are made from *worker addresses* exchanged out of band: the server's
address is what ``start()`` returns (``ucx://<base64 worker address>``), advertised
in the control-plane handshake; the client sends its own in ``UCX_ATTACH``.
Progress runs in ``blocking`` mode on the asyncio loop (the default progress
thread is much slower on small hosts). Call ``configure_ucx_env`` before ``ucxx`` is
imported (UCX reads its environment once).

Tags (64 bits): the high 32 bits are the connection id the client picked, the
low 32 bits say what travels: 0 client->server frames, 1 server->client frames,
``0x80000000 | request id`` the bytes of one chunk. ``ATTACH_TAG`` is the server's
attach tag. UCX matches tags per worker, not per endpoint, so the
connection id is how the server tells its clients apart; it is only used after
the client proved its session (the attach MAC, then the nonce challenge).
Control frames are received with ``tag_probe`` first, so their exact length is
known (UCX itself reports no received length) and a short, long or oversized
frame is refused as such.

A FETCH is answered in batches (as many chunks as the server's send window admits,
usually the whole FETCH): one server->client message carrying the batch's CHUNK
frames back to back (header + key + checksum each, the header's length still
counting the chunk bytes), then each chunk's bytes alone on the chunk's tag, sent
from the pinned slot straight into the reserved slot. The client posts those
receives *before* it sends the FETCH, so the bytes never wait in UCX's unexpected
queue; a key the server lacks gets a CHUNK_MISSING frame in the batch plus a 1-byte
message that completes the posted receive.

Modules: ``runtime`` (environment, workers, progress), ``frames`` (tags,
addresses, frame layout), ``server`` and ``client``. The measurements behind
these choices are in the README's Performance part.

Limits: one UCX server and one asyncio loop per process (ucxx keeps one global
worker bound to the loop that first used it). Without peer error handling a dead
peer is noticed by deadlines only: every wait here has one, and a connection that
misses one is aborted (its posted receives are cancelled) before any reservation
is released. Known gap: over ``sm`` large messages move by CMA
(``process_vm_writev``), and UCX treats a CMA copy into a process that died as
fatal when error handling is off. With ``UCX_RNDV_SCHEME=put_zcopy`` the holder
does the copy, so a *fetcher* survives a holder killed mid-transfer (tested, one
lane), but a *holder* whose fetcher is killed in the middle of a transfer is aborted
by UCX (and with two lanes so can the fetcher, whose lane reads by CMA).
The TCP transport has no such gap; isolating UCX in a helper process is the fix.
Error handling cannot close it either: an endpoint with peer error handling gets
only ``sysv`` for tags, no CMA.
"""
