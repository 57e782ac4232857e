"""The sidecar process set up for bulk copies: caches bypassed, the GIL handed back quickly.

glibc's ``memcpy`` (which ``numpy.copyto`` and ``ctypes.memmove`` end in) writes
through the caches below ``glibc.cpu.x86_non_temporal_threshold`` and with
non-temporal stores above it. glibc derives the threshold from the shared cache
size: 192 MiB on the EPYC hosts this was measured on, so every chunk piece the
sidecar copies (chunks of 2-32 MiB, in pieces between deadline checks) went
through the caches, each destination line read before it was written. Measured
on one core, 1 GiB between two ``/dev/shm`` mappings in 4 MiB pieces: 4.0 GB/s
with glibc's threshold, 9.9 GB/s with a 1 MiB one (one 1 GiB call: 5.8-7.0).
The sidecar never reads a chunk back soon after copying it, so caching its
destination only evicts what other processes use.

The tunable is read once, when the process starts, so ``reexec_for_bulk_copies``
re-executes the sidecar (same PID, arguments and descriptors) with it added to
``GLIBC_TUNABLES``. Entries the user set are kept, the user's own threshold
included; nothing happens off x86-64 glibc. On a GPU host the same applies to
the copies between the sidecar's store and vLLM's pinned host region.

Copies run on threads with the GIL released (``numpy.copyto``, xxhash, NIXL),
but each must take the GIL back to go on, and a thread waiting for it waits up
to Python's switch interval (5 ms) while the event loop runs Python. Measured:
1 GiB of rows copied on one thread in 4 MiB pieces while another thread ran
Python: 2.1 GB/s at 5 ms against 6.1 GB/s at 0.5 ms (idle: 9-14 GB/s); in
32 MiB pieces 4.4 against 11.5 GB/s. The sidecar sets ``SWITCH_INTERVAL_SECONDS``.

One core's memcpy bounds a hit in the pod's own sidecar and, on a GPU host, the
copy of a long prefix into vLLM's rows, so chunks are copied by ``copy_threads()``
threads: one per core of the sidecar's CPU budget (``cpu_budget``: affinity, cgroup
CPU quota, else the container's request), at most ``MAX_COPY_THREADS``.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

from kv_offload_sidecar.cpu_budget import cpu_budget

# glibc tunable: the copy size from which memcpy uses non-temporal stores.
NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
# Copies of at least this many bytes bypass the caches: below every chunk piece, above
# the sidecar's small frames and headers.
NON_TEMPORAL_THRESHOLD = 1 << 20

# Most threads copying chunks between the store and vLLM's rows: a few cores saturate a
# socket's memory bandwidth, more only contend.
MAX_COPY_THREADS = 4
# Python's switch interval in the sidecar: how long a copy thread waits for the GIL at most
# (Python's default is 5 ms).
SWITCH_INTERVAL_SECONDS = 0.0005


def prepare_for_bulk_copies() -> None:
    """Re-execute with the copy threshold unless it is set, then shorten the switch interval."""
    reexec_for_bulk_copies()
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)


def copy_threads() -> int:
    """How many threads copy chunks: one per core of the CPU budget, at most ``MAX_COPY_THREADS``."""
    return min(MAX_COPY_THREADS, cpu_budget().cpus)


def applies_here() -> bool:
    """True on x86-64 Linux with glibc, where the tunable exists."""
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and platform.libc_ver()[0] == "glibc")


def tunables_with_threshold(environ: Mapping[str, str]) -> str | None:
    """``GLIBC_TUNABLES`` with the threshold added, or None when it is already set."""
    current = environ.get("GLIBC_TUNABLES", "")
    entries = [entry for entry in current.split(":") if entry]
    if any(entry.split("=", 1)[0] == NON_TEMPORAL_TUNABLE for entry in entries):
        return None
    return ":".join([*entries, f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD:#x}"])


def reexec_for_bulk_copies() -> None:
    """Re-execute this process with the threshold set; return when it is set already."""
    if not applies_here():
        return
    tunables = tunables_with_threshold(os.environ)
    if tunables is None:
        return
    environ = dict(os.environ, GLIBC_TUNABLES=tunables)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
