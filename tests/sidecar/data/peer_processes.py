"""Data-plane peers in their own processes (transport_peers.py), imported by the tests.

A named module rather than conftest.py: pytest puts every test folder on sys.path,
so ``from conftest import ...`` could resolve to another folder's conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

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
        return self.ask("metrics")

    def ask(self, command: str) -> dict[str, Any]:
        """Send one stdin command (``metrics``, ``nixl``, ``end_sessions``); its JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
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


def run_late_slot_writer(peer: PeerProcess, plane: str, *, tls: str, shm_dir: str, chunks: int,
                         chunk_bytes: int, runs: int = 1, cases: str = "",
                         timeout: float = 120) -> list[dict[str, Any]]:
    """Run ``kv_offload_tools.chaos.late_slot_writer`` (the fetcher of the UCX and NIXL late-writer
    cases) in its own process against ``peer``, which holds chunks 0..``chunks``-1 of
    ``transport_peers``; its ``SlotRun`` dicts."""
    from kv_offload_tools.chaos.late_slot_writer import run_fetcher
    from transport_peers import SESSION_ID, SESSION_KEY, content_of, key_of

    return run_fetcher(plane, ucx_tls=tls, address=peer.address, holder_pid=peer.pid,
                       session=(SESSION_ID, SESSION_KEY),
                       contents={key_of(i): content_of(i, chunk_bytes) for i in range(chunks)},
                       shm_dir=shm_dir, runs=runs, cases=cases, env=ucx_env(tls), timeout=timeout)


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
