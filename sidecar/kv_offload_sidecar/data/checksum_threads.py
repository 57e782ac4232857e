"""Received chunks verified off the event loop, on the cores the sidecar may use.

A plane whose bytes land without the sidecar's Python touching them (UCX: the
rendezvous copies straight into the store slot) still has to hash each chunk
before it becomes visible. Hashed on the event loop, a 16 MiB chunk holds the
loop for 1-2 ms (XXH3 at 7-12 GB/s on one core) while UCX's progress, lookups and
every other peer wait, and the hashes of a fetch all run on one core. Here they
run on ``checksum_threads()`` threads, one per core of the process's CPU budget
(``cpu_budget``: affinity, cgroup quota, else the container's request), at most
``MAX_DATA_LANES``; python-xxhash releases the GIL while it hashes, so the threads
hash in parallel with each other and with the loop.

``checksum_off_loop(buf)`` returns an asyncio future of ``chunk_checksum(buf)``.
``hashes_off_loop(nbytes)`` says when to use it: from ``OFF_LOOP_BYTES`` (the
threshold the TCP plane moves bytes off the loop at; below it the hand-off costs
more than the hash) and only in a process with a second core to hash on. With one
core the thread can only take turns with the loop: measured with one core a side
(``bench transport``, UCX sm, the fetcher pinned to one core, two runs each way),
hashing on a thread moved 0.94-1.01x of hashing on the loop with one UCX lane and
0.87-0.94x with two, its fetcher spending 0.10 CPU-s/GB against 0.06. Callers hash
other chunks in place.

The caller keeps ``buf`` valid until the future is done; a reservation aborted
meanwhile only makes the digest moot (its ``commit`` then answers False).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from kv_offload_sidecar.cpu_budget import cpu_budget
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES, spare_core
from kv_offload_sidecar.settings import MAX_DATA_LANES
from kv_offload_sidecar.store.checksum import BytesLike, chunk_checksum

# Name prefix of the threads that verify checksums (seen in py-spy and /proc).
THREAD_PREFIX = "kv-offload-checksum"

_lock = threading.Lock()
# The process's checksum threads, made at first use.
_pool: dict[str, ThreadPoolExecutor] = {}


def checksum_threads() -> int:
    """Threads that verify received chunks: one per core of the CPU budget, at most ``MAX_DATA_LANES``."""
    return max(1, min(MAX_DATA_LANES, cpu_budget().cpus))


def hashes_off_loop(nbytes: int) -> bool:
    """Whether a chunk of ``nbytes`` is worth handing to a checksum thread: a chunk of at
    least ``OFF_LOOP_BYTES``, in a process whose CPU budget has more than one core (``spare_core``,
    the rule a TCP connection hashes its pieces beside its receive by)."""
    return nbytes >= OFF_LOOP_BYTES and spare_core()


def checksum_off_loop(buf: BytesLike) -> asyncio.Future[int]:
    """``chunk_checksum(buf)`` computed on one of the process's checksum threads."""
    return asyncio.get_running_loop().run_in_executor(_executor(), chunk_checksum, buf)


def _executor() -> ThreadPoolExecutor:
    with _lock:
        pool = _pool.get("pool")
        if pool is None:
            pool = _pool["pool"] = ThreadPoolExecutor(max_workers=checksum_threads(),
                                                      thread_name_prefix=THREAD_PREFIX)
        return pool


__all__ = ["THREAD_PREFIX", "checksum_off_loop", "checksum_threads", "hashes_off_loop"]
