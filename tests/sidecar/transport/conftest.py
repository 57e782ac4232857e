"""Data-plane fixtures: chunk servers in their own processes (transport_peers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS_SCRIPT = os.path.join(HERE, "transport_peers.py")


@dataclass
class PeerProcess:
    """A chunk server running in another process."""

    # The process (stdin takes commands, stdout answers as JSON lines).
    proc: subprocess.Popen
    # Data address it advertises.
    address: str
    # Its pid (SIGKILL it to test a dying peer).
    pid: int

    def metrics(self) -> dict[str, Any]:
        """The server's protocol-error and bytes-sent counters."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("metrics\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


def ucx_env(tls: str) -> dict[str, str]:
    """Environment of a UCX child process (the script configures UCX itself)."""
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("UCX_") or key.startswith("UCXPY_"):
            del env[key]
    env["UCX_TLS"] = tls
    # UCX's own warnings go to stderr: the tests read the peers' JSON on stdout.
    env["UCX_LOG_FILE"] = "stderr"
    return env


@pytest.fixture
def start_peer(shm_dir: str) -> Iterator[Callable[..., PeerProcess]]:
    """Start a chunk server process: ``start_peer(kind="tcp", chunks=16, chunk_bytes=..., corrupt="",
    auth_timeout=5.0)`` (auth_timeout also bounds a frame stalled mid-payload)."""
    started: list[PeerProcess] = []

    def start(kind: str = "tcp", *, tls: str = "sm,self", chunks: int = 16,
              chunk_bytes: int = 256 * 1024, corrupt: str = "", auth_timeout: float = 5.0) -> PeerProcess:
        proc = subprocess.Popen(
            [sys.executable, PEERS_SCRIPT, "serve", "--kind", kind, "--tls", tls,
             "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes), "--corrupt", corrupt,
             "--shm-dir", shm_dir, "--auth-timeout", str(auth_timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=ucx_env(tls) if kind == "ucx" else None,
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


def run_ucx_client(peer: PeerProcess, scenario: str, *, tls: str, shm_dir: str, chunks: int,
                   chunk_bytes: int, timeout: float = 60, lanes: int = 1,
                   corrupt: str = "") -> dict[str, Any]:
    """Run one UCX client scenario in its own process (``lanes`` UCX lanes; ``corrupt``: the
    chunk indices the server corrupted); its JSON outcome."""
    done = subprocess.run(
        [sys.executable, PEERS_SCRIPT, "ucx-client", "--tls", tls, "--scenario", scenario,
         "--address", peer.address, "--server-pid", str(peer.pid), "--chunks", str(chunks),
         "--chunk-bytes", str(chunk_bytes), "--shm-dir", shm_dir, "--lanes", str(lanes),
         "--corrupt", corrupt],
        capture_output=True, text=True, timeout=timeout, env=ucx_env(tls),
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (
        f"UCX client {scenario} exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(lines[-1])
