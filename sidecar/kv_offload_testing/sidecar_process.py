"""SidecarProcess: one ``kv-offload sidecar`` OS process of a LocalPool.

It keeps the command it was started with, so it can be started again after
it exited (same identity, ports and files), and it speaks the sidecar's
control API (``/v1/status``, ``/v1/peers`` with the pool's admin token,
``/metrics``), hands out
engine clients, sends signals and reads the process's memory from ``/proc``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity

from kv_offload_testing.frozen import freeze
from kv_offload_testing.http_client import http_json, http_text
from kv_offload_testing.scrape import Samples, parse_metrics, value


# The model identity the tools' stand-in engines state (a simulated engine, a test's
# EngineClient): every sidecar of a LocalPool shares under it unless told otherwise.
STAND_IN_IDENTITY = ModelIdentity(weights="stand-in:kv-offload-tools", dtype="float16",
                                  kv_cache_dtype="float16", kv_layout="stand-in/LBHNC/cpu",
                                  block_size="16", hash_algo="sha256")


class SidecarProcess:
    """One sidecar process on 127.0.0.1; made (not yet started) by ``LocalPool``."""

    def __init__(self, index: int, identity: str, base_port: int, dp_indices: tuple[int, ...],
                 transport: str, argv: Sequence[str], env: Mapping[str, str], log_path: str,
                 expect_connect: bool, admin_token: str = "",
                 model_identity: ModelIdentity | None = STAND_IN_IDENTITY) -> None:
        # Position in the pool (0-based).
        self.index = index
        # --identity of the sidecar.
        self.identity = identity
        # Control port of global DP index 0 (DP index i listens on base_port + i).
        self.base_port = base_port
        # Global DP indices it serves.
        self.dp_indices = dp_indices
        # Data-plane transport.
        self.transport = transport
        self.host = "127.0.0.1"
        # The command line and environment it runs with (every start).
        self.argv = list(argv)
        self.env = dict(env)
        # Its log (stdout and stderr, appended across starts).
        self.log_path = log_path
        # True for members of the pool's full mesh: every other member should connect to it.
        # False for a sidecar built to be rejected, or given its own peers.
        self.expect_connect = expect_connect
        # Bearer token of its admin endpoints (/v1/status, /v1/peers, /v1/lookup); "" = none.
        self.admin_token = admin_token
        # The identity a stand-in engine states once it is ready (and every client it hands
        # out): the sidecar shares nothing before an engine did. None: a real engine states it.
        self.model_identity = model_identity
        # The running (or last) process; None before the first start.
        self.proc: subprocess.Popen[bytes] | None = None
        # Times started (an engine client made before a restart maps the old store).
        self.starts = 0
        self._term_sent = False

    # ---- process ------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float = 60.0) -> None:
        """Spawn its command (again, after it exited) and wait for ``/readyz`` unless ``wait`` is False."""
        if self.alive():
            raise RuntimeError(f"{self.identity} is still running; stop or kill it first")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.starts += 1
        self._term_sent = False
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until it answers ``/readyz`` with 200 (then a stand-in engine states ``model_identity``
        to it); RuntimeError if it exits first, TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"{self.identity} exited with code {code}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if self.get("/readyz", timeout=2.0)[0] == 200:
                    if self.model_identity is not None:
                        self.client().close()  # a stand-in engine states the identity
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.identity} not ready in time:\n{self.log_tail()}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT, a SIGKILL left unreaped, ...) if it runs."""
        if self.proc is not None:
            self.proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread has stopped (``frozen.freeze``), if it runs."""
        if self.proc is not None:
            freeze(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL, no cleanup (a crash), and reap."""
        if self.alive():
            self.proc.kill()  # type: ignore[union-attr]
        if self.proc is not None:
            self.proc.wait(10)

    def sigterm(self) -> None:
        """Begin a graceful stop: SIGTERM, once per start."""
        if self.alive() and not self._term_sent:
            self._term_sent = True
            self.send(signal.SIGTERM)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (once), then SIGKILL after ``timeout``; returns the exit code."""
        assert self.proc is not None, f"{self.identity} was never started"
        self.sigterm()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Stuck: have it print its thread stacks into its log, then kill it.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            self.proc.kill()
            print(f"LocalPool: {self.identity} ignored SIGTERM for {timeout}s; its log ends:\n"
                  f"{self.log_tail(60)}", file=sys.stderr)
        return self.proc.wait(10)

    def rss_bytes(self) -> int:
        """Resident set size of the process (``VmRSS`` of ``/proc/<pid>/status``)."""
        assert self.proc is not None, f"{self.identity} was never started"
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    # ---- control API ----------------------------------------------------------------

    @property
    def port(self) -> int:
        """Control port of its first DP index."""
        return self.base_port + self.dp_indices[0]

    @property
    def address(self) -> str:
        """``host:port`` of its first control port."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Base URL of its first control port, e.g. http://127.0.0.1:40123."""
        return f"http://{self.host}:{self.port}"

    def _auth(self, auth: bool) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if auth and self.admin_token else {}

    def get(self, path: str, timeout: float = 5.0, *, auth: bool = True) -> tuple[int, Any]:
        """GET ``path``, with the admin token unless ``auth`` is False."""
        return http_json(self.url + path, timeout=timeout, headers=self._auth(auth))

    def post(self, path: str, body: Any, timeout: float = 5.0, *, auth: bool = True) -> tuple[int, Any]:
        """POST ``body`` to ``path``, with the admin token unless ``auth`` is False."""
        return http_json(self.url + path, body=body, timeout=timeout, headers=self._auth(auth))

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        code, body = self.get("/v1/status", timeout=timeout)
        if code != 200 or not isinstance(body, dict):
            raise RuntimeError(f"{self.identity}: /v1/status answered {code}: {body!r}")
        return body

    def peers(self) -> list[dict[str, Any]]:
        return self.get("/v1/peers")[1]["peers"]

    def held(self, keys: Sequence[bytes], timeout: float = 5.0) -> tuple[int, int]:
        """Leading ``keys`` it holds itself and, after those, the pool holds: ``(local, peer)``,
        asked with the admin lookup (nothing moves)."""
        code, body = self.post("/v1/lookup", {"keys": [k.hex() for k in keys]}, timeout=timeout)
        if code != 200 or not isinstance(body, dict):
            raise RuntimeError(f"{self.identity}: /v1/lookup answered {code}: {body!r}")
        return int(body["local"]), int(body["peer"])

    def hits(self, keys: Sequence[bytes], timeout: float = 5.0) -> int:
        """Leading ``keys`` it or the pool holds (``held``, added)."""
        return sum(self.held(keys, timeout))

    def metrics_text(self) -> str:
        return http_text(self.url + "/metrics")

    def metrics(self) -> Samples:
        """Every ``/metrics`` sample, keyed by (name, label pairs)."""
        return parse_metrics(self.metrics_text())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples ``name`` whose labels include ``labels`` (0.0 when absent),
        e.g. metric("kv_offload_handshakes_total", reason="replay")."""
        return value(self.metrics(), name, **labels)

    def client(self, dp_index: int | None = None, timeout: float = 5.0) -> EngineClient:
        """A new EngineClient of one DP port (the first by default); it maps the current store."""
        idx = self.dp_indices[0] if dp_index is None else dp_index
        states = None if self.model_identity is None else self.model_identity.statement()
        return EngineClient.connect(self.host, self.base_port + idx, timeout, states=states)
