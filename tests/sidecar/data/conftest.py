"""Data-plane fixtures: chunk servers in their own processes (see peer_processes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.store.chunk_store import ChunkStore
from peer_processes import PEERS_SCRIPT, PeerProcess, ucx_env

# Chunk size of the fetching side's stores unless a test asks for another.
STORE_CHUNK = 256 * 1024


@pytest.fixture
def make_store(shm_dir: str) -> Iterator[Callable[..., ChunkStore]]:
    """Chunk stores in this process (the fetching side): ``make_store(slots=20, chunk_bytes=...)``."""
    stores: list[ChunkStore] = []

    def make(slots: int = 20, chunk_bytes: int = STORE_CHUNK, **kw: Any) -> ChunkStore:
        store = ChunkStore(chunk_bytes, slots * slot_stride_for(chunk_bytes), directory=shm_dir,
                           name=f"t{len(stores)}-{os.getpid()}", **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def start_peer(shm_dir: str) -> Iterator[Callable[..., PeerProcess]]:
    """Start a chunk server process: ``start_peer(kind="tcp", tls=None, chunks=16, chunk_bytes=..., corrupt="",
    auth_timeout=5.0, certs=None, log_file="")`` (auth_timeout also bounds a frame stalled mid-payload
    and a TLS handshake; ``certs``, a ``kv_offload_testing.certs.CertFiles``, serves TCP under TLS;
    ``log_file`` receives its log from INFO up; ``tls``: ``UCX_TLS`` of a ucx server, default
    "sm,self", or of a nixl server's UCX, default the suite's)."""
    started: list[PeerProcess] = []

    def start(kind: str = "tcp", *, tls: str | None = None, chunks: int = 16,
              chunk_bytes: int = 256 * 1024, corrupt: str = "", auth_timeout: float = 5.0,
              certs: Any = None, log_file: str = "") -> PeerProcess:
        extra_args = [] if certs is None else ["--tls-cert-file", certs.cert_file, "--tls-key-file",
                                             certs.key_file, "--tls-ca-file", certs.ca_file]
        if log_file:
            extra_args += ["--log-file", log_file]
        proc = subprocess.Popen(
            [sys.executable, PEERS_SCRIPT, "serve", "--kind", kind, "--tls", tls or "sm,self",
             "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes), "--corrupt", corrupt,
             "--shm-dir", shm_dir, "--auth-timeout", str(auth_timeout), *extra_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=ucx_env(tls or "sm,self") if kind == "ucx" or tls else None,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise RuntimeError(f"chunk server exited with {proc.returncode} before advertising an address")
        info = json.loads(line)
        peer = PeerProcess(proc, info["address"], info["pid"])
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.stop()
