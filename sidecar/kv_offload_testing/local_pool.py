"""LocalPool: ``kv-offload sidecar`` OS processes on 127.0.0.1 (tests, demo, benches, chaos).

It writes an offloading config and a pool key into a fresh work directory
(under /dev/shm when available, which also holds the store files, local
sockets and logs), starts N sidecars on free ports with each other as static
peers, waits until every one is ready and connected to all others, and stops
them with SIGTERM (then SIGKILL), removing the work directory. Every sidecar
runs with ``--parent-pid`` of this process, so it shuts down (and unlinks its
store) when this process dies without stopping the pool (SIGKILL, a killed
bench); the work directory's name carries this process's id, and the next
LocalPool on the machine removes directories whose owner is gone
(``sweep_stale_workdirs``).

More sidecars join with ``add``: by default as members of the full mesh, or
with an identity, peers and store budget of the caller's choosing (the chaos
bench builds its hub and servers this way; ``LocalPool(0)`` starts empty).
A ``SidecarOverride`` gives one sidecar another config (fingerprint, chunk
size), pool key, hash seed or transport, for rejection tests; such a sidecar
is not expected to connect. ``local_hello`` is the hello a member would send,
for hand-driven peers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.engine.contract.offloading_config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kv_offload_sidecar.commands.sidecar import process_alive
from kv_offload_sidecar.peers.directory.location_wire import key_digest
from kv_offload_sidecar.peers.directory.ownership import OwnerTable
from kv_offload_sidecar.peers.handshake import HelloMessage, make_hello
from kv_offload_sidecar.settings import DEFAULT_HASH_SEED, effective_hash_seed

# Re-exported: the tests import these helpers from here.
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY, SidecarProcess

DEFAULT_POOL_KEY = b"local-pool-key-not-a-secret"


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
    # The sidecar still joins the pool's mesh (the override only adds flags that keep it
    # compatible); by default an overridden sidecar is expected to be refused.
    joins: bool = False
    # Another model identity for its stand-in engine to state (None: the pool's).
    model_identity: ModelIdentity | None = None


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


# Ports handed out for control ports: below Linux's ephemeral range (32768-60999), so a
# port reserved here and released cannot be taken meanwhile by another process's
# outgoing connection or by a listener bound to port 0 (a data plane, UCX).
RESERVED_PORT_RANGE = (20000, 32000)
# Ports this process handed out already (two pools of one test never get the same one).
_HANDED_OUT: set[int] = set()


def free_port_block(count: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port p such that p .. p+count-1 were all free just now (outside the ephemeral range)."""
    low, high = RESERVED_PORT_RANGE
    for _ in range(attempts):
        base = random.randrange(low, high - count)
        if _HANDED_OUT.intersection(range(base, base + count)):
            continue
        socks = []
        try:
            for p in range(base, base + count):
                t = socket.socket()
                socks.append(t)
                t.bind((host, p))
            _HANDED_OUT.update(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"found no block of {count} free ports on {host}")


def _until_none(lacking: Callable[[], list[str]], timeout: float, failure: str) -> None:
    """Until ``lacking()`` names nothing, polled; TimeoutError with ``failure`` and what it names after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while missing := lacking():
        if time.monotonic() > deadline:
            raise TimeoutError(failure + "; ".join(missing))
        time.sleep(0.05)


def sidecar_command() -> list[str]:
    """argv prefix running ``kv-offload`` with this interpreter."""
    script = os.path.join(os.path.dirname(sys.executable), "kv-offload")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "kv_offload_operator.cli"]


class LocalPool:
    """Sidecar processes on 127.0.0.1 sharing one config and pool key; a context manager."""

    # What a sidecar of the pool is (a NetnsPool's run in network namespaces).
    process_class: type[SidecarProcess] = SidecarProcess

    def __init__(self, n: int = 3, *, transport: str = "tcp", config: OffloadingConfig | None = None,
                 pool_key: bytes = DEFAULT_POOL_KEY, capacity_bytes: int = 32 << 20,
                 dp_indices: Sequence[int] = (0,), fetch_deadline_seconds: float = 2.0,
                 publish_interval_seconds: float = 0.2, shutdown_grace_seconds: float = 2.0,
                 overrides: Mapping[int, SidecarOverride] | None = None,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 workdir: str | None = None, log_level: str = "INFO",
                 launcher: Callable[[Sequence[str], Mapping[str, str]], list[str]] | None = None,
                 model_identity: ModelIdentity | None = STAND_IN_IDENTITY,
                 declared_identity: Mapping[str, str] | None = None) -> None:
        # Sidecars start() launches (add() launches more).
        self.n = n
        self.transport = transport
        self.config = config or example_config()
        self.pool_key = pool_key
        # Bearer token of every sidecar's admin endpoints (written to --admin-token-file).
        self.admin_token = secrets.token_hex(16)
        # Store budget of each sidecar unless add() is given another.
        self.capacity_bytes = capacity_bytes
        self.dp_indices = tuple(dp_indices)
        self.fetch_deadline_seconds = fetch_deadline_seconds
        self.publish_interval_seconds = publish_interval_seconds
        self.shutdown_grace_seconds = shutdown_grace_seconds
        # Sidecar index -> how it differs, for the n sidecars of start().
        self.overrides = dict(overrides or {})
        # Environment and flags of every sidecar (over this process's environment).
        self.env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.log_level = log_level
        # (kv-offload arguments, environment) -> the argv that runs them; None runs this
        # interpreter's kv-offload (image_smoke runs the image's, in a container).
        self.launcher = launcher
        # What each sidecar's stand-in engine states once it is ready (sidecars share nothing
        # before); None: real engines will (then ``start`` does not wait for the mesh, which
        # forms once the engines attached: ``wait_connected``).
        self.model_identity = model_identity
        # What the pool's config file declares of the identity (its "model_identity", as the
        # operator's ConfigMap states the vllm serve line's part); {}: nothing.
        self.declared_identity = dict(declared_identity or {})
        self._own_workdir = workdir is None
        # Config, key, logs, store files and local sockets (the sidecars' --shm-dir).
        self.workdir = workdir or make_workdir()
        self.sidecars: list[SidecarProcess] = []
        self._files: dict[str, str] = {}

    # ---- what the pool shares -------------------------------------------------------

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk (the config's ``kv_bytes_per_chunk``)."""
        return self.config.kv_bytes_per_chunk

    @property
    def hash_seed(self) -> str:
        """The prefix-hash seed the sidecars compare: the config's, else their PYTHONHASHSEED."""
        return effective_hash_seed(self.config, {"PYTHONHASHSEED": self._environment()["PYTHONHASHSEED"]})

    @property
    def config_path(self) -> str:
        """The pool's config file (what ``--config`` of its sidecars names)."""
        return self._config_file(self.config)

    def local_hello(self, *, identity: str = "probe") -> HelloMessage:
        """The hello a member of this pool sends, for a peer driven by hand (probes, attacks)."""
        return make_hello(
            fingerprint=self.config.fingerprint, hash_seed=self.hash_seed,
            kv_bytes_per_chunk=self.chunk_bytes, identity=identity, control_address="127.0.0.1:9",
            data_address="tcp://127.0.0.1:9", transport="tcp", run_config=self.config.run_config(),
            model_identity=self.model_identity or STAND_IN_IDENTITY)

    # ---- files ----------------------------------------------------------------

    def _file(self, name: str, data: bytes) -> str:
        path = os.path.join(self.workdir, name)
        with open(path, "wb") as fh:
            fh.write(data)
        os.chmod(path, 0o600)
        return path

    def _config_file(self, config: OffloadingConfig) -> str:
        key = f"config-{config.fingerprint}-{config.kv_bytes_per_chunk}.json"
        if key not in self._files:
            document = {**config.to_dict(), "model_identity": self.declared_identity}
            self._files[key] = self._file(key, json.dumps(document, indent=2).encode())
        return self._files[key]

    def _secret_dir(self, identity: str, key: bytes) -> str:
        """The sidecar's own copy of the pool Secret (``key``, ``previous-key``), as a pod mounts it."""
        directory = os.path.join(self.workdir, f"{identity}-secret")
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700)
            self.write_keys(identity, key)
        return directory

    def write_keys(self, identity: str, current: bytes, previous: bytes | None = None) -> None:
        """Replace a sidecar's key files the way kubelet updates a Secret volume (atomically);
        the sidecar picks them up at its next ``--key-reload-seconds`` tick."""
        directory = os.path.join(self.workdir, f"{identity}-secret")
        for name, value in (("key", current), ("previous-key", previous)):
            path = os.path.join(directory, name)
            if value is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(value)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)

    # ---- processes ------------------------------------------------------------

    def _environment(self, override: SidecarOverride | None = None) -> dict[str, str]:
        """A sidecar's environment: this process's without proxies, the pool's, the override's."""
        o = override or SidecarOverride()
        env = dict(os.environ)
        for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            env.pop(var, None)
        env.setdefault("UCXPY_PROGRESS_MODE", "blocking")
        env["PYTHONHASHSEED"] = DEFAULT_HASH_SEED
        env.update(self.env)
        if o.hash_seed is not None:
            env["PYTHONHASHSEED"] = o.hash_seed
        env.update(o.env)
        return env

    def _sidecar(self, identity: str, base_port: int, peers: Sequence[str],
                 override: SidecarOverride | None, capacity_bytes: int | None,
                 expect_connect: bool) -> SidecarProcess:
        """A SidecarProcess (not started) whose static peers are the addresses ``peers``."""
        o = override or SidecarOverride()
        transport = o.transport or self.transport
        args = ["sidecar",
                "--config", self._config_file(o.config or self.config),
                "--pool-key-file", os.path.join(self._secret_dir(identity, o.pool_key or self.pool_key), "key"),
                "--previous-pool-key-file", os.path.join(self.workdir, f"{identity}-secret", "previous-key"),
                "--admin-token-file", self._file("admin-token", self.admin_token.encode()),
                "--host", "127.0.0.1", "--base-port", str(base_port),
                "--dp-indices", ",".join(map(str, self.dp_indices)),
                "--data-port", "0", "--capacity-bytes", str(capacity_bytes or self.capacity_bytes),
                "--transport", transport, "--shm-dir", self.workdir, "--identity", identity,
                "--fetch-deadline-seconds", str(self.fetch_deadline_seconds),
                "--publish-interval-seconds", str(self.publish_interval_seconds),
                "--shutdown-grace-seconds", str(self.shutdown_grace_seconds),
                "--log-level", self.log_level, "--parent-pid", str(os.getpid()),
                *self.extra_args, *o.extra_args]
        if peers:
            args += ["--peers", ",".join(peers)]
        env = self._environment(override)
        argv = self.launcher(args, env) if self.launcher else [*sidecar_command(), *args]
        return self.process_class(len(self.sidecars), identity, base_port, self.dp_indices, transport, argv,
                              env, os.path.join(self.workdir, f"{identity}.log"),
                              expect_connect, admin_token=self.admin_token,
                              model_identity=o.model_identity or self.model_identity)

    def start(self, timeout: float = 60.0) -> "LocalPool":
        """Start the N sidecars and wait until all are ready and connected."""
        try:
            ports = [free_port_block(max(self.dp_indices) + 1) for _ in range(self.n)]
            addrs = [f"127.0.0.1:{p + self.dp_indices[0]}" for p in ports]
            self._start_members([(f"sidecar-{i}", ports[i], [a for j, a in enumerate(addrs) if j != i])
                                 for i in range(self.n)], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_members(self, members: Sequence[tuple[str, int, Sequence[str]]], timeout: float) -> None:
        """One sidecar per ``(identity, base port, static peers)``, the i-th with override i;
        waits until all are ready and (with stand-in engines) connected."""
        for i, (identity, port, peers) in enumerate(members):
            override = self.overrides.get(i)
            sc = self._sidecar(identity, port, peers, override, None,
                               expect_connect=override is None or override.joins)
            self.sidecars.append(sc)
            sc.start(wait=False)
        self.wait_ready(timeout)
        if self.model_identity is not None:
            self.wait_connected(timeout)

    def add(self, override: SidecarOverride | None = None, *, identity: str | None = None,
            peers: Sequence[str] | None = None, capacity_bytes: int | None = None,
            timeout: float = 60.0, wait_connected: bool | None = None) -> SidecarProcess:
        """Start one more sidecar and wait until it is ready.

        Without ``peers`` it joins the full mesh: every running sidecar is its
        static peer, the others learn of it when it handshakes with them, and
        (unless it has an override) this waits until all members are connected.
        ``peers`` names the identities it dials instead (possibly none); such a
        sidecar is outside the mesh and nothing waits for its connections.
        ``identity`` defaults to ``sidecar-<index>``; ``capacity_bytes`` to the pool's.
        """
        identity = identity or f"sidecar-{len(self.sidecars)}"
        if any(s.identity == identity for s in self.sidecars):
            raise ValueError(f"the pool already has a sidecar called {identity!r}")
        mesh = peers is None
        addresses = [s.address for s in self.sidecars if s.alive()] if mesh \
            else [self[p].address for p in peers]  # type: ignore[union-attr]
        sc = self._sidecar(identity, free_port_block(max(self.dp_indices) + 1), addresses, override,
                           capacity_bytes, expect_connect=mesh and (override is None or override.joins))
        self.sidecars.append(sc)
        sc.start(timeout=timeout)
        if (sc.expect_connect and sc.model_identity is not None) if wait_connected is None \
                else wait_connected:
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
        sc.start(timeout=timeout)
        if sc.expect_connect and sc.model_identity is not None:
            self.wait_connected(timeout)
        return sc

    def set_peers(self, identity: str, peers: Sequence[str]) -> None:
        """The sidecars ``identity`` dials from its next start on (by identity)."""
        sc = self[identity]
        addresses = ",".join(self[p].address for p in peers)
        argv = sc.argv
        if "--peers" in argv:
            argv[argv.index("--peers") + 1] = addresses
        elif addresses:
            argv += ["--peers", addresses]

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for sc in self.sidecars:
            sc.wait_ready(max(0.0, deadline - time.monotonic()))

    def members(self) -> list[SidecarProcess]:
        """Running sidecars of the full mesh (the ones that should connect to each other)."""
        return [s for s in self.sidecars if s.expect_connect and s.alive()]

    def owners_of(self, key: bytes) -> list[str]:
        """The identities that keep ``key``'s location, best first (whom a lookup asks), as
        every member computes them while all the members see each other."""
        table = OwnerTable(self.members()[0].identity)
        for sc in self.members()[1:]:
            table.add(sc.identity)
        return table.owners_of(key_digest(key))

    def wait_connected(self, timeout: float = 60.0) -> None:
        """Until every member has a connected session with every other member."""
        def missing() -> list[str]:
            members = self.members()
            want = {s.identity for s in members}
            missing = []
            for sc in members:
                got = {p["identity"] for p in sc.peers() if p["state"] == "connected"}
                lacking = (want - {sc.identity}) - got
                if lacking:
                    missing.append(f"{sc.identity} lacks {sorted(lacking)}")
            return missing

        _until_none(missing, timeout, "peers did not connect: ")

    def wait_directory_current(self, timeout: float = 30.0) -> None:
        """Until the pool's chunk directory is current: every member sees all the others, none
        has changes left to publish, and the owners keep one entry per chunk the members hold
        and owner it has (``owners_per_chunk``: two, or one in a pool of one)."""
        def stale() -> list[str]:
            members = self.members()
            views = {s.identity: s.status()["location"] for s in members}
            stale = [f"{name} sees {v['members']} members, has {v['pending']} changes unpublished"
                     for name, v in views.items() if v["members"] != len(members) or v["pending"]]
            held = sum(v["keys"] * v["owners_per_chunk"] for v in views.values())
            kept = sum(v["entries"] for v in views.values())
            if held != kept:
                stale.append(f"the owners keep {kept} entries for the {held} (chunk, owner) pairs held")
            return stale

        _until_none(stale, timeout, "the directory did not converge: ")

    def client(self, index: int, dp_index: int | None = None, timeout: float = 5.0) -> EngineClient:
        return self.sidecars[index].client(dp_index, timeout)

    def __getitem__(self, key: int | str) -> SidecarProcess:
        """A sidecar by position, or by identity."""
        if isinstance(key, str):
            for sc in self.sidecars:
                if sc.identity == key:
                    return sc
            raise KeyError(f"the pool has no sidecar called {key!r}")
        return self.sidecars[key]

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """SIGTERM every sidecar (SIGKILL after ``timeout``); returns exit codes by identity."""
        for sc in self.sidecars:
            sc.send(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            sc.sigterm()
        codes = {sc.identity: sc.terminate(timeout) for sc in self.sidecars if sc.proc is not None}
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return codes

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
