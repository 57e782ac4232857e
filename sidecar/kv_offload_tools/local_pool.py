"""LocalPool: several ``kv-offload sidecar`` OS processes on 127.0.0.1.

Used by the process-level tests, the demo, the benchmarks and the Prometheus
test. It writes an offloading config and a pool key into a fresh work
directory (under /dev/shm when available, which also holds the store files and
local sockets), starts N sidecars on free ports with each other as static
peers, waits until every one is ready and connected to all others, and stops
them with SIGTERM (then SIGKILL), removing the work directory. Every sidecar
runs with ``--parent-pid`` of this process, so it shuts down (and unlinks its
store) when this process dies without stopping the pool (SIGKILL, a killed
bench); the work directory's name carries this process's id, and the next
LocalPool on the machine removes directories whose owner is gone
(``sweep_stale_workdirs``). Per-sidecar ``SidecarOverride``s give one
sidecar another config (fingerprint, chunk size), pool key, hash seed or
transport, for rejection tests; such a sidecar is not expected to connect.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.engine.offloading_config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kv_offload_sidecar.main import process_alive

DEFAULT_POOL_KEY = b"local-pool-key-not-a-secret"
DEFAULT_HASH_SEED = "0"


def example_config(*, model: str = "Qwen/Qwen3-0.6B", dtype: str = "bfloat16",
                   tokens_per_block: int = 16, blocks_per_chunk: int = 4, tokens_per_hash: int = 16,
                   worker_kv_bytes_per_block: int = 4096, num_layers: int = 2,
                   data_parallel_size: int = 1, extra_config: dict[str, Any] | None = None,
                   engine_id: str = "kv-offload-local") -> OffloadingConfig:
    """A small parallelism-agnostic config: one KV group, 16 KiB chunks by default."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, tuple(f"model.layers.{i}.self_attn.attn"
                                                              for i in range(num_layers)), 0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra_config or {},
        engine_id=engine_id,
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(tokens_per_hash, blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=data_parallel_size,
            data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


@dataclass(frozen=True)
class SidecarOverride:
    """How one sidecar of a LocalPool differs from the pool (for rejection tests)."""

    # Another offloading config (another fingerprint, or another chunk size).
    config: OffloadingConfig | None = None
    # Another pool key.
    pool_key: bytes | None = None
    # Another PYTHONHASHSEED (hence another effective hash seed).
    hash_seed: str | None = None
    # Another data-plane transport ("tcp" or "ucx").
    transport: str | None = None
    # Extra command-line flags for this sidecar.
    extra_args: tuple[str, ...] = ()
    # Extra environment variables for this sidecar.
    env: Mapping[str, str] = field(default_factory=dict)


# Prefix of LocalPool work directories: "{prefix}{owner pid}-{random}".
WORKDIR_PREFIX = "kvo-"
_OWNED_DIR = re.compile(r"^(?P<prefix>[a-z-]+?-)(?P<pid>\d+)-[A-Za-z0-9_]+$")


def shm_parent() -> str | None:
    """/dev/shm when writable (store files and sockets belong in memory), else the temp dir."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def sweep_stale_workdirs(prefix: str = WORKDIR_PREFIX, parent: str | None = None) -> list[str]:
    """Remove ``{prefix}{pid}-*`` directories under ``parent`` whose owning process is gone.

    They are left behind when the process that made them was killed before it
    could stop its pool. Returns the removed paths.
    """
    parent = parent or shm_parent() or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = _OWNED_DIR.match(name)
        if not m or m.group("prefix") != prefix or process_alive(int(m.group("pid"))):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_workdir(prefix: str = WORKDIR_PREFIX, parent: str | None = None) -> str:
    """A fresh ``{prefix}{this pid}-*`` directory (after sweeping dead owners' ones)."""
    parent = parent or shm_parent()
    sweep_stale_workdirs(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def free_port_block(count: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port p such that p .. p+count-1 were all free just now."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + count - 1 > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + count):
                t = socket.socket()
                socks.append(t)
                t.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"found no block of {count} free ports on {host}")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, decoded JSON or text) of a GET (or POST when body is given)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(sample name, labels): value}."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


class SidecarProcess:
    """One running ``kv-offload sidecar`` of a LocalPool."""

    def __init__(self, index: int, identity: str, base_port: int, dp_indices: tuple[int, ...],
                 transport: str, workdir: str, proc: subprocess.Popen[bytes], log_path: str,
                 expect_connect: bool, argv: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
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
        self.workdir = workdir
        self.proc = proc
        self.log_path = log_path
        # False for sidecars built to be rejected by the others.
        self.expect_connect = expect_connect
        self._term_sent = False
        self._argv = list(argv)
        self._env = dict(env or {})

    def respawn(self) -> None:
        """Start the same command again (same identity, ports, files) after it exited."""
        if self.alive():
            raise RuntimeError(f"{self.identity} is still running; stop or kill it first")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self._env, start_new_session=True)
        self._term_sent = False

    @property
    def port(self) -> int:
        """Control port of its first DP index."""
        return self.base_port + self.dp_indices[0]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Base URL of its first control port, e.g. http://127.0.0.1:40123."""
        return f"http://{self.host}:{self.port}"

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        return http_json(self.url + path, timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 5.0) -> tuple[int, Any]:
        return http_json(self.url + path, body=body, timeout=timeout)

    def status(self) -> dict[str, Any]:
        code, body = self.get("/v1/status")
        if code != 200:
            raise RuntimeError(f"{self.identity}: /v1/status answered {code}: {body}")
        return body

    def peers(self) -> list[dict[str, Any]]:
        return self.get("/v1/peers")[1]["peers"]

    def metrics_text(self) -> str:
        with _OPENER.open(self.url + "/metrics", timeout=5.0) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample (0.0 when absent), e.g. metric("kv_offload_handshakes_total", reason="replay")."""
        want = set(labels.items())
        total = 0.0
        for (sample, lab), value in parse_metrics(self.metrics_text()).items():
            if sample == name and want <= set(lab):
                total += value
        return total

    def client(self, dp_index: int | None = None, timeout: float = 5.0) -> EngineClient:
        """An EngineClient of one DP port (the first by default)."""
        idx = self.dp_indices[0] if dp_index is None else dp_index
        return EngineClient.connect(self.host, self.base_port + idx, timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, no cleanup (a crash)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (once), then SIGKILL after ``timeout``; returns the exit code."""
        if self.alive() and not self._term_sent:
            self._term_sent = True
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Stuck: have it print its thread stacks into its log, then kill it.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            self.proc.kill()
        return self.proc.wait(10)


def sidecar_command() -> list[str]:
    """argv prefix running ``kv-offload`` with this interpreter."""
    script = os.path.join(os.path.dirname(sys.executable), "kv-offload")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "kv_offload_operator.cli"]


class LocalPool:
    """N sidecar processes on 127.0.0.1 sharing chunks; a context manager."""

    def __init__(self, n: int = 3, *, transport: str = "tcp", config: OffloadingConfig | None = None,
                 pool_key: bytes = DEFAULT_POOL_KEY, capacity_bytes: int = 32 << 20,
                 dp_indices: Sequence[int] = (0,), fetch_deadline_seconds: float = 2.0,
                 summary_interval_seconds: float = 0.2, shutdown_grace_seconds: float = 2.0,
                 overrides: Mapping[int, SidecarOverride] | None = None,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 workdir: str | None = None, log_level: str = "INFO") -> None:
        self.n = n
        self.transport = transport
        self.config = config or example_config()
        self.pool_key = pool_key
        self.capacity_bytes = capacity_bytes
        self.dp_indices = tuple(dp_indices)
        self.fetch_deadline_seconds = fetch_deadline_seconds
        self.summary_interval_seconds = summary_interval_seconds
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self.overrides = dict(overrides or {})
        self.env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.log_level = log_level
        self._own_workdir = workdir is None
        self.workdir = workdir or make_workdir()
        self.sidecars: list[SidecarProcess] = []
        self._files: dict[str, str] = {}

    # ---- files ----------------------------------------------------------------

    def _file(self, name: str, data: bytes) -> str:
        path = os.path.join(self.workdir, name)
        with open(path, "wb") as fh:
            fh.write(data)
        os.chmod(path, 0o600)
        return path

    def _config_file(self, config: OffloadingConfig) -> str:
        text = config.to_json()
        key = f"config-{config.fingerprint}-{config.kv_bytes_per_chunk}.json"
        if key not in self._files:
            self._files[key] = self._file(key, text.encode())
        return self._files[key]

    def _key_file(self, key: bytes) -> str:
        name = f"pool-key-{hashlib.sha256(key).hexdigest()[:12]}"
        if name not in self._files:
            self._files[name] = self._file(name, key)
        return self._files[name]

    # ---- processes ------------------------------------------------------------

    def _launch(self, index: int, base_port: int, peers: Sequence[str],
                override: SidecarOverride | None) -> SidecarProcess:
        o = override or SidecarOverride()
        identity = f"sidecar-{index}"
        transport = o.transport or self.transport
        argv = [*sidecar_command(), "sidecar",
                "--config", self._config_file(o.config or self.config),
                "--pool-key-file", self._key_file(o.pool_key or self.pool_key),
                "--host", "127.0.0.1", "--base-port", str(base_port),
                "--dp-indices", ",".join(map(str, self.dp_indices)),
                "--data-port", "0", "--capacity-bytes", str(self.capacity_bytes),
                "--transport", transport, "--shm-dir", self.workdir, "--identity", identity,
                "--fetch-deadline-seconds", str(self.fetch_deadline_seconds),
                "--summary-interval-seconds", str(self.summary_interval_seconds),
                "--shutdown-grace-seconds", str(self.shutdown_grace_seconds),
                "--log-level", self.log_level, "--parent-pid", str(os.getpid()),
                *self.extra_args, *o.extra_args]
        if peers:
            argv += ["--peers", ",".join(peers)]
        env = dict(os.environ)
        for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            env.pop(var, None)
        env.setdefault("UCXPY_PROGRESS_MODE", "blocking")
        env["PYTHONHASHSEED"] = DEFAULT_HASH_SEED
        env.update(self.env)
        if o.hash_seed is not None:
            env["PYTHONHASHSEED"] = o.hash_seed
        env.update(o.env)
        log_path = os.path.join(self.workdir, f"{identity}.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        return SidecarProcess(index, identity, base_port, self.dp_indices, transport, self.workdir,
                              proc, log_path, expect_connect=override is None, argv=argv, env=env)

    def start(self, timeout: float = 60.0) -> "LocalPool":
        """Start the N sidecars and wait until all are ready and connected."""
        try:
            ports = [free_port_block(max(self.dp_indices) + 1) for _ in range(self.n)]
            addrs = [f"127.0.0.1:{p + self.dp_indices[0]}" for p in ports]
            for i in range(self.n):
                peers = [a for j, a in enumerate(addrs) if j != i]
                self.sidecars.append(self._launch(i, ports[i], peers, self.overrides.get(i)))
            self.wait_ready(timeout)
            self.wait_connected(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def add(self, override: SidecarOverride | None = None, *, timeout: float = 60.0,
            wait_connected: bool | None = None) -> SidecarProcess:
        """Start one more sidecar with the pool's sidecars as its static peers.

        The others learn of it when it handshakes with them. Waits for its
        readiness, and (unless it has an override) until all are connected.
        """
        base = free_port_block(max(self.dp_indices) + 1)
        peers = [s.address for s in self.sidecars if s.alive()]
        sc = self._launch(len(self.sidecars), base, peers, override)
        self.sidecars.append(sc)
        self._wait_ready_one(sc, time.monotonic() + timeout)
        if wait_connected if wait_connected is not None else override is None:
            self.wait_connected(timeout)
        return sc

    def restart(self, index: int, *, kill: bool = False, timeout: float = 60.0) -> SidecarProcess:
        """Stop sidecar ``index`` (SIGTERM, or SIGKILL with ``kill``), start it again with the
        same identity and ports, and wait until it is ready (and connected, for members)."""
        sc = self.sidecars[index]
        if kill:
            sc.kill()
        else:
            sc.terminate()
        sc.respawn()
        self._wait_ready_one(sc, time.monotonic() + timeout)
        if sc.expect_connect:
            self.wait_connected(timeout)
        return sc

    def _wait_ready_one(self, sc: SidecarProcess, deadline: float) -> None:
        while True:
            if not sc.alive():
                raise RuntimeError(f"{sc.identity} exited with code {sc.proc.returncode}:\n{sc.log_tail()}")
            try:
                if sc.get("/readyz", timeout=2.0)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sc.identity} not ready in time:\n{sc.log_tail()}")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for sc in self.sidecars:
            self._wait_ready_one(sc, deadline)

    def members(self) -> list[SidecarProcess]:
        """Running sidecars without overrides (the ones that should connect)."""
        return [s for s in self.sidecars if s.expect_connect and s.alive()]

    def wait_connected(self, timeout: float = 60.0) -> None:
        """Until every member has a connected session with every other member."""
        deadline = time.monotonic() + timeout
        while True:
            members = self.members()
            want = {s.identity for s in members}
            missing = []
            for sc in members:
                got = {p["identity"] for p in sc.peers() if p["state"] == "connected"}
                lacking = (want - {sc.identity}) - got
                if lacking:
                    missing.append(f"{sc.identity} lacks {sorted(lacking)}")
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("peers did not connect: " + "; ".join(missing))
            time.sleep(0.05)

    def wait_summaries(self, timeout: float = 30.0) -> None:
        """Until every member's view of every other member's keys is current."""
        deadline = time.monotonic() + timeout
        while True:
            members = self.members()
            own = {s.identity: s.status()["summary"]["keys"] for s in members}
            stale = []
            for sc in members:
                for p in sc.peers():
                    if p["identity"] in own and p["state"] == "connected" \
                            and p["summary_keys"] != own[p["identity"]]:
                        stale.append(f"{sc.identity} sees {p['summary_keys']} of {p['identity']}'s "
                                     f"{own[p['identity']]}")
            if not stale:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("summaries did not converge: " + "; ".join(stale))
            time.sleep(0.05)

    def client(self, index: int, dp_index: int | None = None, timeout: float = 5.0) -> EngineClient:
        return self.sidecars[index].client(dp_index, timeout)

    def __getitem__(self, index: int) -> SidecarProcess:
        return self.sidecars[index]

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """SIGTERM every sidecar (SIGKILL after ``timeout``); returns exit codes by identity."""
        for sc in self.sidecars:
            if sc.alive() and not sc._term_sent:
                sc._term_sent = True
                sc.proc.send_signal(signal.SIGTERM)
        codes = {}
        for sc in self.sidecars:
            codes[sc.identity] = sc.terminate(timeout)
            if codes[sc.identity] == -signal.SIGKILL and sc._term_sent:
                print(f"LocalPool: {sc.identity} ignored SIGTERM for {timeout}s; its log ends:\n"
                      f"{sc.log_tail(60)}", file=sys.stderr)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return codes

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
