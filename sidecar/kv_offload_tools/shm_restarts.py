"""A sidecar SIGKILLed again and again on a size-bounded /dev/shm, under an engine client mapping its store.

``bounded_tmpfs(size)`` mounts a tmpfs of ``size`` bytes on a fresh directory (root only;
``tmpfs_unavailable()`` says why not), the workdir of a ``LocalPool``: its store file,
sockets and logs then share one volume sized like the pod's ``/dev/shm``, which holds one
store, not two. ``kill_and_recover(pool, client)`` kills sidecar 0 with SIGKILL while
``client`` (the real ``EngineClient``, as vLLM's tier holds it) maps its store, starts it
again at once, and drives the client like an engine (look up; on a miss recompute and
store; on a hit load and check the bytes) until its chunks are hits again. The
``Recovery`` it returns says when the new sidecar served and when the engine hit again,
the misses on the way, and every exception that reached the engine (there must be none).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kv_offload_sidecar.engine.client import EngineClient

from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_testing.local_pool import LocalPool
from kv_offload_testing.sidecar_process import SidecarProcess

# Seconds between two engine steps while the sidecar comes back.
STEP_SECONDS = 0.05
# Seconds a round may take before it counts as not recovered.
ROUND_LIMIT_SECONDS = 60.0


def tmpfs_unavailable() -> str | None:
    """Why this process cannot mount a tmpfs (None: it can)."""
    if not os.uname().sysname == "Linux":
        return "a size-bounded tmpfs needs Linux"
    if os.geteuid() != 0:
        return "mounting a size-bounded tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount are not installed"
    return None


@contextlib.contextmanager
def bounded_tmpfs(size: int, prefix: str = "kvo-shm-") -> Iterator[str]:
    """A fresh directory with a tmpfs of ``size`` bytes mounted on it, unmounted after."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        os.rmdir(path)
        raise RuntimeError(f"cannot mount a tmpfs of {size} bytes on {path}: {exc}") from None
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False, capture_output=True, timeout=30)
        os.rmdir(path)


def used_bytes(path: str) -> int:
    """Bytes in use on the file system of ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@dataclass(frozen=True)
class Recovery:
    """One SIGKILL of the sidecar and what the engine saw until it hit again."""

    # Seconds from the kill until the new sidecar answered /readyz (None: never in the round).
    served_seconds: float | None
    # Seconds from the kill until the engine's chunks were hits again, loaded whole
    # (None: never in the round).
    hit_seconds: float | None
    # Engine steps that missed (lookup, store or load) on the way.
    misses: int
    # Chunks loaded whose bytes were wrong (must be 0).
    corrupt: int
    # Exceptions that reached the engine from the client, as text (must be none).
    raised: tuple[str, ...]
    # Bytes in use on the store's volume once the engine hit again (one store, not two).
    shm_used_bytes: int


def kill_and_recover(pool: LocalPool, client: EngineClient, round_no: int = 0, *,
                     keys: int = 4) -> Recovery:
    """SIGKILL sidecar 0 of ``pool`` under ``client``, start it again, drive the client until
    ``keys`` chunks it stores are hits again (see the module docstring)."""
    sc = pool[0]
    nbytes = pool.chunk_bytes
    names = chunk_keys(f"shm-restart-{round_no}", keys)
    killed = time.monotonic()
    sc.kill()
    sc.start(wait=False)
    served: float | None = None
    misses = corrupt = 0
    raised: list[str] = []
    while time.monotonic() - killed < ROUND_LIMIT_SECONDS:
        if served is None and _answers_ready(sc):
            served = time.monotonic() - killed
        try:
            if client.lookup(names).local >= keys:
                read, bad = load_and_verify(client, names, nbytes)
                corrupt += bad
                if read == keys and bad == 0:
                    hit = time.monotonic() - killed
                    sc.wait_ready()
                    return Recovery(served if served is not None else hit, hit, misses, corrupt,
                                    tuple(raised), used_bytes(pool.workdir))
            misses += 1
            store_chunks(client, names, nbytes)  # recomputed, offered again
        except Exception as exc:  # the tier must never see one
            raised.append(f"{type(exc).__name__}: {exc}")
        time.sleep(STEP_SECONDS)
    return Recovery(served, None, misses, corrupt, tuple(raised), used_bytes(pool.workdir))


def _answers_ready(sc: SidecarProcess) -> bool:
    try:
        return sc.alive() and sc.get("/readyz", timeout=1.0)[0] == 200
    except Exception:  # not up yet (refused, reset, half an answer)
        return False
