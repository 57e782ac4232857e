"""The NIXL methods of ``kv-offload bench transport``.

- ``nixl``: the sidecar's nixl transport: a peer fetch that READs each chunk from the
  holder's store slot straight into a reserved store slot, hashed piece by piece as it
  lands and verified before it becomes visible (the product path; integrity always on).
- ``nixl_unverified``: the same path with the lanes' hashing off (the chunk is committed
  with the holder's checksum): what verification costs is the gap between the two rows.
- ``nixl_bare``: bare NIXL, no transport: one agent per process, the holder's chunks
  registered and its whole metadata handed over, the fetcher READs whole chunks into its
  own registered buffer, ``BARE_IN_FLIGHT`` at a time, busy-polling, nothing verified,
  no store bookkeeping: the reference the nixl rows are measured against.

NIXL's Python logger writes to stdout, which carries the bench's JSON lines: every
method imports it through ``runtime.import_nixl`` (which routes it to logging).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
from typing import Any

# The nixl methods; the table lists them after the UCX ones.
NIXL_METHODS = ("nixl", "nixl_unverified", "nixl_bare")
# Chunks the bare fetcher keeps in flight.
BARE_IN_FLIGHT = 8


def prepare_worker(method: str) -> None:
    """Before anything imports NIXL in a worker process of ``method``."""
    from kv_offload_sidecar.data.nixl.runtime import configure_nixl_env

    configure_nixl_env()
    if method == "nixl_unverified":
        from kv_offload_sidecar.data.nixl.client import NixlPeerDataClient

        NixlPeerDataClient.verify = False


def _agent(name: str) -> Any:
    from kv_offload_sidecar.data.nixl.runtime import import_nixl

    nixl = import_nixl()
    return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def run_bare_server(views: list[memoryview], commands: Any, emit: Any) -> None:
    """Register ``views`` (a store's pinned chunks), print their metadata, serve passively:
    NIXL progress every millisecond while the process waits for the next command."""
    import threading

    import numpy as np

    agent = _agent(f"bench-holder-{os.getpid()}")
    addresses = [int(np.frombuffer(v, dtype=np.uint8).ctypes.data) for v in views]
    agent.register_memory([(a, len(v), 0, "") for a, v in zip(addresses, views)], "DRAM")
    emit({"address": json.dumps({"metadata": agent.get_agent_metadata().hex(), "chunks": addresses})})
    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(0.001):
            agent.get_new_notifs()

    pump = threading.Thread(target=progress, daemon=True)
    pump.start()
    for _ in commands:
        pass
    stop.set()
    pump.join()


def fetch_pool(shm_dir: str, prefix: str, nbytes: int) -> tuple[mmap.mmap, Any]:
    """A bare fetcher's buffer: ``nbytes`` of an unlinked file in ``shm_dir``, mapped, and its
    numpy bytes with every page faulted in."""
    import numpy as np

    path = os.path.join(shm_dir, f"{prefix}-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    pool = np.frombuffer(mapped, dtype=np.uint8)
    pool[:] = 0  # fault every page in
    return mapped, pool


class NixlBareFetcher:
    """The fetcher of ``nixl_bare``: whole-chunk READs into a registered buffer, busy-polled."""

    def __init__(self, args: argparse.Namespace, size: int, n: int) -> None:
        info = json.loads(args.address.split("|")[0])
        self.size, self.n = size, n
        self.remote_chunks = info["chunks"]
        self.map, self.pool = fetch_pool(args.shm_dir, "bench-nixl-bare", size * n)
        base = int(self.pool.ctypes.data)
        self.agent = _agent(f"bench-fetcher-{os.getpid()}")
        self.agent.register_memory([(base, size * n, 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(bytes.fromhex(info["metadata"]))
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * size, size, 0) for i in range(n)],
                                                "DRAM")
        self.far = self.agent.prep_xfer_dlist(self.remote, [(a, size, 0) for a in self.remote_chunks], "DRAM")

    async def fetch_set(self, s: int) -> None:
        agent, posted, i = self.agent, [], 0
        while i < self.n or posted:
            while i < self.n and len(posted) < BARE_IN_FLIGHT:
                xfer = agent.make_prepped_xfer("READ", self.local, [i], self.far, [s * self.n + i])
                if agent.transfer(xfer) == "ERR":
                    raise RuntimeError("bare NIXL READ failed to post")
                posted.append(xfer)
                i += 1
            still = []
            for xfer in posted:
                state = agent.check_xfer_state(xfer)
                if state == "PROC":
                    still.append(xfer)
                    continue
                xfer.release()
                if state != "DONE":
                    raise RuntimeError(f"bare NIXL READ ended in state {state}")
            posted = still

    def digests(self, s: int) -> list[int]:
        import xxhash

        return [xxhash.xxh3_64_intdigest(self.pool[i * self.size:(i + 1) * self.size]) for i in range(self.n)]

    async def round_trips(self, seconds: float) -> tuple[list[float], list[float]]:
        return [], []

    async def close(self) -> None:
        for handle in (self.local, self.far):
            handle.release()
        self.agent.remove_remote_agent(self.remote)
