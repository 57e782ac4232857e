"""Real sidecar processes and a hand-driven peer for the chaos bench and its tests.

- ``ChaosPool``: writes a pool config and key, starts ``kv-offload sidecar``
  processes on 127.0.0.1 (free ports, one shm directory), and lets a caller
  SIGKILL, SIGSTOP/SIGCONT, SIGTERM and restart each one by name.
- ``SidecarProcess``: one of them: pid, ports, ``/v1/status``, ``/metrics``,
  RSS from ``/proc``.
- ``probe_handshake``: the two-step control-plane handshake done by hand
  (``handshake.HandshakeInitiator``), giving a real ``Session`` or the
  sidecar's rejection; ``RawDataConnection``: a blocking data-plane socket
  that speaks ``protocol`` frames, authenticated or not.
- ``chunk_content(key, n)``: the deterministic bytes of a chunk, so any
  delivered chunk can be checked byte for byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import auth_proof
from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.engine.offloading_config import OffloadingConfig
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HandshakeInitiator,
    HelloMessage,
    Session,
    make_hello,
)
from kv_offload_sidecar.settings import effective_hash_seed

from kv_offload_tools.local_pool import example_config, make_workdir

# Seconds a started sidecar has to answer /readyz.
START_TIMEOUT_SECONDS = 30.0
# Hash seed written into the chaos pool's config (no dependence on PYTHONHASHSEED).
CHAOS_HASH_SEED = "kv-offload-chaos"


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just had free (bind 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def chunk_content(key: bytes, nbytes: int) -> bytes:
    """Deterministic pseudo-random bytes of the chunk named ``key``."""
    seed = int.from_bytes(hashlib.sha256(b"chaos chunk\x00" + key).digest()[:8], "big")
    return np.random.Generator(np.random.PCG64(seed)).bytes(nbytes)


def chunk_keys(prefix: str, n: int) -> list[bytes]:
    """``n`` distinct chunk keys (16-byte hash + 4-byte group index, like vLLM's OffloadKey)."""
    return [hashlib.sha256(f"{prefix}/{i}".encode()).digest()[:16] + b"\x00\x00\x00\x00"
            for i in range(n)]


def store_chunks(engine: EngineClient, keys: Sequence[bytes], nbytes: int) -> int:
    """Store the deterministic content of ``keys`` through an engine client; returns chunks written."""

    def write(i: int, view: memoryview) -> None:
        view[:] = chunk_content(keys[i], nbytes)

    return engine.store(keys, write)


def load_and_verify(engine: EngineClient, keys: Sequence[bytes], nbytes: int,
                    timeout: float = 2.0) -> tuple[int, int]:
    """Load ``keys`` through an engine client; returns (chunks read, chunks whose bytes were wrong)."""
    bad = [0]

    def read(i: int, view: memoryview) -> None:
        if view != chunk_content(keys[i], nbytes):
            bad[0] += 1

    n = engine.load(keys, read, timeout)
    return n, bad[0]


def http_json(address: str, method: str, path: str, body: Any = None, *,
              raw: bytes | None = None, headers: dict[str, str] | None = None,
              timeout: float = 5.0) -> tuple[int, Any]:
    """One HTTP request to ``host:port``; returns (status, parsed JSON or raw text)."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        text = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text.decode("utf-8", "replace")


@dataclass
class SidecarProcess:
    """One ``kv-offload sidecar`` process of a ChaosPool."""

    # Name in the pool (--identity).
    identity: str
    # Control port (DP index 0).
    base_port: int
    # Extra command-line flags.
    argv: list[str]
    # Log file of the process (appended across restarts).
    log_path: str
    # The running process, None before start.
    proc: subprocess.Popen[bytes] | None = None
    # Times started.
    starts: int = 0

    @property
    def control_address(self) -> str:
        return f"127.0.0.1:{self.base_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"sidecar {self.identity} was never started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, wait: bool = True, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Spawn the process (and wait for /readyz unless ``wait`` is False)."""
        if self.alive:
            raise RuntimeError(f"sidecar {self.identity} is already running")
        env = dict(os.environ)
        for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            env.pop(var, None)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kv_offload_operator.cli", "sidecar", *self.argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        finally:
            log.close()
        self.starts += 1
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive:
                raise RuntimeError(f"sidecar {self.identity} exited with {self.proc.returncode if self.proc else None}"
                                   f" before it was ready; log: {self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = http_json(self.control_address, "GET", "/readyz", timeout=1.0)
                if status == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"sidecar {self.identity} not ready within {timeout}s; log: {self.log_tail()}")

    def send(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, return the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        code, body = http_json(self.control_address, "GET", "/v1/status", timeout=timeout)
        if code != 200 or not isinstance(body, dict):
            raise RuntimeError(f"sidecar {self.identity} /v1/status answered {code}: {body!r}")
        return body

    def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        """``/metrics`` samples as {"name{labels}": value}."""
        code, text = http_json(self.control_address, "GET", "/metrics", timeout=timeout)
        if code != 200 or not isinstance(text, str):
            raise RuntimeError(f"sidecar {self.identity} /metrics answered {code}")
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def engine(self, timeout: float = 5.0) -> EngineClient:
        """A new engine client of this sidecar (maps its current store file)."""
        return EngineClient.connect("127.0.0.1", self.base_port, timeout=timeout)

    def rss_bytes(self) -> int:
        """Resident set size from /proc/<pid>/status."""
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path, "rb") as fh:
                return " | ".join(fh.read().decode("utf-8", "replace").splitlines()[-lines:])
        return ""


@dataclass
class ChaosPool:
    """A pool of real sidecar processes on 127.0.0.1 sharing one config and key."""

    # Bytes of one chunk (worker_kv_bytes_per_block * blocks_per_chunk).
    chunk_bytes: int = 64 * 1024
    # Store budget of each sidecar (bytes) unless given per sidecar.
    capacity_bytes: int = 16 << 20
    # Peer fetch deadline of every sidecar (seconds).
    fetch_deadline_seconds: float = 1.0
    # Key-summary pull interval (seconds).
    summary_interval_seconds: float = 0.2
    # SIGTERM grace (seconds).
    shutdown_grace_seconds: float = 3.0
    # The pool key bytes.
    pool_key: bytes = b"chaos-pool-key-0123456789abcdef"
    # Working directory (config, key, logs); made when empty.
    workdir: str = ""
    # Sidecars by identity.
    sidecars: dict[str, SidecarProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chunk_bytes % 4:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a multiple of 4")
        # Both named after this process, so a later pool removes them if this one is killed.
        self._own_workdir = not self.workdir
        self.workdir = self.workdir or make_workdir("kv-offload-chaos-", tempfile.gettempdir())
        self.shm_dir = make_workdir("kvc-")
        self.config: OffloadingConfig = example_config(
            worker_kv_bytes_per_block=self.chunk_bytes // 4, blocks_per_chunk=4,
            extra_config={"hash_seed": CHAOS_HASH_SEED})
        self.config_path = os.path.join(self.workdir, "offloading_config.json")
        with open(self.config_path, "w") as fh:
            fh.write(self.config.to_json())
        self.key_path = os.path.join(self.workdir, "pool.key")
        with open(self.key_path, "wb") as fh:
            fh.write(self.pool_key)
        os.chmod(self.key_path, 0o600)

    @property
    def hash_seed(self) -> str:
        return effective_hash_seed(self.config)

    def add(self, identity: str, *, peers: Iterable[str] = (), capacity_bytes: int | None = None,
            start: bool = True, extra: Sequence[str] = ()) -> SidecarProcess:
        """Create (and start) a sidecar; ``peers`` are identities already added."""
        port = free_port()
        argv = ["--config", self.config_path, "--pool-key-file", self.key_path,
                "--host", "127.0.0.1", "--base-port", str(port), "--data-port", "0",
                "--capacity-bytes", str(capacity_bytes or self.capacity_bytes),
                "--transport", "tcp", "--shm-dir", self.shm_dir, "--identity", identity,
                "--fetch-deadline-seconds", str(self.fetch_deadline_seconds),
                "--summary-interval-seconds", str(self.summary_interval_seconds),
                "--shutdown-grace-seconds", str(self.shutdown_grace_seconds),
                "--log-level", "WARNING", "--parent-pid", str(os.getpid()), *extra]
        peer_addrs = [self.sidecars[p].control_address for p in peers]
        if peer_addrs:
            argv += ["--peers", ",".join(peer_addrs)]
        sc = SidecarProcess(identity, port, argv, os.path.join(self.workdir, f"{identity}.log"))
        self.sidecars[identity] = sc
        if start:
            sc.start()
        return sc

    def __getitem__(self, identity: str) -> SidecarProcess:
        return self.sidecars[identity]

    def local_hello(self, *, identity: str = "chaos-probe", control_address: str = "127.0.0.1:9",
                    fingerprint: str | None = None, hash_seed: str | None = None,
                    kv_bytes_per_chunk: int | None = None) -> HelloMessage:
        """A hello as a pool member would send it (fields overridable for attacks)."""
        return make_hello(
            fingerprint=self.config.fingerprint if fingerprint is None else fingerprint,
            hash_seed=self.hash_seed if hash_seed is None else hash_seed,
            kv_bytes_per_chunk=self.chunk_bytes if kv_bytes_per_chunk is None else kv_bytes_per_chunk,
            identity=identity, control_address=control_address,
            data_address="tcp://127.0.0.1:9", transport="tcp", run_config=self.config.run_config())

    def close(self) -> None:
        """SIGKILL whatever still runs and remove the working files."""
        for sc in self.sidecars.values():
            sc.send(signal.SIGCONT)
            sc.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ChaosPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ProbeSession:
    """What a hand-driven handshake produced."""

    # The established session (id and key for data connections).
    session: Session
    # The sidecar's hello (its data address, identity).
    server_hello: HelloMessage
    # The two HTTP bodies sent (for replay attacks).
    sent: tuple[dict[str, Any], dict[str, Any]]


def probe_handshake(control_address: str, pool_key: bytes, hello: HelloMessage,
                    timeout: float = 5.0) -> ProbeSession:
    """Both handshake steps against a sidecar; HandshakeError when refused either way."""
    initiator = HandshakeInitiator(pool_key, hello)
    step1 = initiator.step1()
    status, reply = http_json(control_address, "POST", "/v1/handshake", step1, timeout=timeout)
    if status != 200:
        reason = reply.get("reason", "malformed") if isinstance(reply, dict) else "malformed"
        raise HandshakeError(str(reason), f"step 1 refused with HTTP {status}: {reply!r}")
    server_hello, step2, session = initiator.check_reply(reply)
    status, reply = http_json(control_address, "POST", "/v1/handshake", step2, timeout=timeout)
    if status != 200:
        reason = reply.get("reason", "malformed") if isinstance(reply, dict) else "malformed"
        raise HandshakeError(str(reason), f"step 2 refused with HTTP {status}: {reply!r}")
    return ProbeSession(session, server_hello, (step1, step2))


class RawDataConnection:
    """A blocking socket to a data-plane port that reads and writes raw frames."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        rest = address.removeprefix("tcp://")
        host, _, port = rest.rpartition(":")
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        self.nonce = b""

    def read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            buf += part
        return bytes(buf)

    def read_frame(self) -> tuple[proto.Header, bytes]:
        """One frame (header + whole payload, CHUNK data included)."""
        header = proto.decode_header(self.read_exact(proto.HEADER_BYTES))
        return header, self.read_exact(header.length)

    def read_challenge(self) -> bytes:
        header, payload = self.read_frame()
        if header.type is not proto.MessageType.AUTH_CHALLENGE:
            raise ConnectionError(f"expected AUTH_CHALLENGE, got {header.type.name}")
        self.nonce = proto.decode_auth_challenge(payload)
        return self.nonce

    def authenticate(self, session: Session) -> None:
        """Answer the challenge with the session; ConnectionError unless AUTH_OK."""
        nonce = self.nonce or self.read_challenge()
        self.send(proto.encode_auth_response(session.session_id, auth_proof(session.session_key, nonce)))
        header, payload = self.read_frame()
        if header.type is not proto.MessageType.AUTH_OK:
            raise ConnectionError(f"authentication refused: {header.type.name} {payload[:200]!r}")

    def send(self, parts: Sequence[bytes | memoryview] | bytes) -> None:
        self.sock.sendall(parts if isinstance(parts, bytes) else b"".join(bytes(p) for p in parts))

    def read_until_closed(self, limit: int = 1 << 24) -> list[tuple[proto.Header | None, bytes]]:
        """Every frame until the server closes (or ``limit`` bytes); a bad frame ends the list."""
        frames: list[tuple[proto.Header | None, bytes]] = []
        total = 0
        while total < limit:
            try:
                head = self.read_exact(proto.HEADER_BYTES)
            except (ConnectionError, OSError):
                return frames
            try:
                header = proto.decode_header(head)
            except proto.ProtocolError:
                frames.append((None, head))
                return frames
            try:
                payload = self.read_exact(header.length)
            except (ConnectionError, OSError):
                frames.append((header, b""))
                return frames
            total += len(payload) + len(head)
            frames.append((header, payload))
        return frames

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> RawDataConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
