"""Everything one sidecar process is configured with, in one frozen struct of groups.

``commands/sidecar.py`` builds a ``SidecarSettings`` from flags, the environment and the
pool's ``OffloadingConfig``; the rest of the sidecar only reads it. As kopf's
``OperatorSettings`` does, the struct holds one frozen dataclass per group of what a user
tunes together: ``settings.pool``, ``.network``, ``.store``, ``.data_plane``, ``.peers``,
``.recompute``, ``.security``, ``.process`` (so ``settings.peers.fetch_deadline_seconds``,
``settings.store.capacity_bytes``). A field made with ``setting(default, help)`` is a
``kv-offload sidecar`` flag whose default and help are written only there (``setting_flags``);
the flag keeps the field's name (``--fetch-deadline-seconds``: names are unique across groups,
a test holds it so), and the operator's pool defaults read them too (``pool_spec``). Values
no user or test sets are class constants of their group, not fields. ``GROUPS`` is derived
from the group fields (``setting_groups``): the argparse groups of ``kv-offload sidecar --help``
and the tables of docs/reference/settings.md. ``SidecarSettings.of`` builds the struct from
one keyword per setting (the flags' values, a test's few changes). Each group checks its own
values; ``SidecarSettings`` checks those that span two groups (TLS needs the tcp plane).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.setting_flags import SettingGroup, group, grouped, setting, setting_groups

# Most streams one fetch stripes over (``lanes``, ``data.lanes``): past 8 streams loopback TCP on a
# 16-core host (10.8 GB/s) already passes a GPU's break-even several times, and each lane
# holds a thread and socket buffers on both ends.
MAX_DATA_LANES = 8

# The data plane's port when none is given.
DEFAULT_DATA_PORT = 5810
# Used as hash seed when neither the pool config nor PYTHONHASHSEED names one.
DEFAULT_HASH_SEED = "0"
# extra_config key through which a pool pins the hash seed explicitly.
HASH_SEED_CONFIG_KEY = "hash_seed"
TRANSPORTS = ("ucx", "tcp", "nixl")
# What a sidecar keeps of a chunk fetched from a peer once the engine loaded it:
# "drop" (nothing: the pool keeps one copy, at its holder) or "cold" (a copy, evicted first).
PEER_COPIES = ("drop", "cold")


def effective_hash_seed(config: OffloadingConfig, environ: Mapping[str, str] | None = None, *,
                        flag: str | None = None) -> str:
    """The prefix-hash seed peers must share.

    An explicit ``flag`` (``--hash-seed``) wins; then the pool config's
    ``extra_config["hash_seed"]``; then the process's ``PYTHONHASHSEED``;
    otherwise ``DEFAULT_HASH_SEED``.
    """
    if flag is not None and flag != "":
        return flag
    env = os.environ if environ is None else environ
    stated = config.extra_config.get(HASH_SEED_CONFIG_KEY)
    if stated is not None and str(stated) != "":
        return str(stated)
    seed = env.get("PYTHONHASHSEED", "")
    return seed if seed != "" else DEFAULT_HASH_SEED


def default_identity(base_port: int) -> str:
    """Pod name (the hostname in Kubernetes) plus base port: unique per sidecar."""
    return f"{socket.gethostname()}:{base_port}"


@dataclass(frozen=True, kw_only=True)
class PoolSettings:
    """``settings.pool``; the kv bytes of one chunk follow from its config."""

    config: OffloadingConfig = setting(
        help="offloading_config.json of the pool (the operator's ConfigMap)", metavar="FILE", required=True)
    hash_seed: str = setting(DEFAULT_HASH_SEED, "prefix-hash seed shared by the pool, compared in the "
                             "handshake", metavar="S", default_text="the config's extra_config hash_seed, "
                             f"else $PYTHONHASHSEED, else {DEFAULT_HASH_SEED}")
    # The model identity fields the pool's ConfigMap declares (its "model_identity": the
    # vllm serve line's part, engine/contract/model_identity.DECLARED_FIELDS), read from the config file.
    declared_identity: Mapping[str, str] = field(default_factory=dict)
    # Why the --config file was refused at this start ("" = it was used): the sidecar then runs
    # the last good config this pod saved (last_good_config.py) and says so in /v1/status.
    config_rejected: str = ""

    @property
    def kv_bytes_per_chunk(self) -> int:
        """Bytes of one chunk (the store's slot size and the wire chunk size)."""
        return self.config.kv_bytes_per_chunk


@dataclass(frozen=True, kw_only=True)
class NetworkSettings:
    """``settings.network``: ports checked to fit, identity defaulted from the base port."""

    # Largest accepted HTTP request body on the control ports, in bytes (a constant).
    max_body_bytes: ClassVar[int] = 256 * 1024

    host: str = setting(ports.DEFAULT_HOST, "address to bind and advertise to peers (the routable pod IP)",
                        default_text=f"${ports.ENV_HOST}, else {ports.DEFAULT_HOST}")
    base_port: int = setting(ports.DEFAULT_BASE_PORT, "control port of global DP index 0; DP index i "
                             "listens on base_port + i",
                             default_text=f"${ports.ENV_PORT}, else {ports.DEFAULT_BASE_PORT}")
    dp_indices: tuple[int, ...] = setting((0,), "global data-parallel indices this pod serves, e.g. 2,3",
                                          metavar="I,...", default_text="0")
    data_port: int = setting(DEFAULT_DATA_PORT, "TCP data-plane port (0: any free port); UCX picks its own")
    identity: str = setting("", "name of this sidecar among its peers (unique in the pool), e.g. the pod name",
                            default_text="hostname:base_port")

    def __post_init__(self) -> None:
        if not self.dp_indices or any(i < 0 for i in self.dp_indices):
            raise ValueError(f"dp_indices {self.dp_indices!r} must be non-negative global DP indices")
        if len(set(self.dp_indices)) != len(self.dp_indices):
            raise ValueError(f"dp_indices {self.dp_indices!r} repeat an index")
        if not 0 < self.base_port or self.base_port + max(self.dp_indices) > 65535:
            raise ValueError(
                f"base_port {self.base_port} + DP index {max(self.dp_indices)} is not a valid port")
        if not 0 <= self.data_port <= 65535:
            raise ValueError(f"data_port {self.data_port} is not a valid port (0-65535)")
        if not self.identity:
            object.__setattr__(self, "identity", default_identity(self.base_port))

    def control_port(self, dp_index: int) -> int:
        """The control port of a global DP index (``engine.contract.ports.control_port``)."""
        return ports.control_port(self.base_port, dp_index)

    @property
    def control_ports(self) -> tuple[int, ...]:
        return tuple(self.control_port(i) for i in self.dp_indices)


@dataclass(frozen=True, kw_only=True)
class StoreSettings:
    """``settings.store``: a positive budget, a known peer_copies."""

    capacity_bytes: int = setting(1 << 30, "byte budget of the host-memory chunk store (never exceeded)")
    shm_dir: str = setting("/dev/shm", "directory of the shared-memory store file and local channel sockets")
    peer_copies: str = setting("drop", "what to keep of a chunk fetched from a peer once the engine loaded it: "
                               "drop (the pool keeps one copy, at its holder) or cold (a copy, evicted first)",
                               choices=PEER_COPIES)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes {self.capacity_bytes} must be positive")
        if self.peer_copies not in PEER_COPIES:
            raise ValueError(f"peer_copies {self.peer_copies!r} is not one of {list(PEER_COPIES)}")


@dataclass(frozen=True, kw_only=True)
class DataPlaneSettings:
    """``settings.data_plane``: a known transport, lanes within MAX_DATA_LANES."""

    transport: str = setting("ucx", "data plane: ucx (ucxx), tcp (plain asyncio sockets, where UCX is "
                             "unavailable) or nixl (one-sided NIXL READs)", choices=TRANSPORTS)
    lanes: int = setting(0, "parallel streams a fetch from one peer stripes its chunks over, each moving "
                         "bytes on a core of its own; the fewer of both sidecars' offers is used. Per plane: "
                         "tcp connections (TLS too), nixl read threads (a NIXL agent each), ucx 1 or 2 "
                         "connections (2: the fetcher copies too) (0: one per core this process may use, at "
                         f"most {MAX_DATA_LANES}; ucx: 1)", metavar="N")

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {list(TRANSPORTS)}")
        if isinstance(self.lanes, bool) or not 0 <= self.lanes <= MAX_DATA_LANES:
            raise ValueError(f"lanes {self.lanes!r} must be 0 (one per usable core) "
                             f"or 1-{MAX_DATA_LANES}")


@dataclass(frozen=True, kw_only=True)
class PeerSettings:
    """``settings.peers``, with the constants of dialling peers (no user or test sets them)."""

    # Seconds between DNS re-resolutions of peers_dns: how soon a new pod is dialled (pods
    # that reach us first are dialled back at once, and nobody tuned it).
    dns_interval_seconds: ClassVar[float] = 10.0
    # Deadline of one handshake (both HTTP steps) with a peer.
    handshake_timeout_seconds: ClassVar[float] = 5.0
    # Cap of the first back-off delay after a peer failed (the delay is drawn below it: full
    # jitter); the cap doubles per failure up to backoff_max_seconds.
    backoff_initial_seconds: ClassVar[float] = 0.5
    # Largest cap of the back-off delay of a failing or rejecting peer.
    backoff_max_seconds: ClassVar[float] = 30.0

    static_peers: tuple[str, ...] = setting((), "static peer control addresses (one DP port per peer is "
                                            "enough)", flag="--peers", metavar="H:P,...", default_text="none")
    peers_dns: str = setting("", "DNS name of the pool's headless Service, re-resolved periodically",
                             metavar="NAME")
    publish_interval_seconds: float = setting(
        1.0, "seconds between publishes of this sidecar's chunk changes to their directory owners "
        "(how stale a peer's view of them may be)")
    fetch_deadline_seconds: float = setting(2.0, "deadline of one peer lookup or fetch; late or failed is a miss")

    def __post_init__(self) -> None:
        for name in ("publish_interval_seconds", "fetch_deadline_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class RecomputeSettings:
    """``settings.recompute``: a rate >= 0, an http(s) metrics URL, a positive interval."""

    prefill_tokens_per_second: float = setting(
        0.0, "the engine's prefill rate in prompt tokens per second: a peer's run slower to fetch than to "
        "recompute at this rate is a miss (0: always fetch)", metavar="TOKENS")
    engine_metrics_url: str = setting("", "vLLM's /metrics, to learn the engine's prefill rate from, "
                                      "e.g. http://127.0.0.1:8000/metrics ('': the configured rate only)",
                                      metavar="URL")
    engine_metrics_interval_seconds: float = setting(15.0, "seconds between scrapes of --engine-metrics-url")

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_second >= 0:
            raise ValueError(f"prefill_tokens_per_second {self.prefill_tokens_per_second} must be >= 0 "
                             "(the engine's prompt tokens per second; 0 always fetches)")
        if self.engine_metrics_url and not self.engine_metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-metrics-url {self.engine_metrics_url!r} must be an http(s) URL "
                             "of vLLM's /metrics, e.g. http://127.0.0.1:8000/metrics")
        if self.engine_metrics_interval_seconds <= 0:
            raise ValueError(f"engine_metrics_interval_seconds must be positive, "
                             f"got {self.engine_metrics_interval_seconds}")


@dataclass(frozen=True, kw_only=True)
class SecuritySettings:
    """``settings.security``, with the keys read from its files: a pool key, TLS all or none."""

    pool_key_file: str = setting(
        "", "file holding the pool's secret key (the operator's Secret); re-read every key_reload_seconds, so "
        "a rotated Secret takes effect without a restart", metavar="FILE", required=True)
    previous_pool_key_file: str = setting(
        "", "file of the pool's previous key, accepted while a key rotation rolls out (absent or empty: none)",
        metavar="FILE")
    admin_token_file: str = setting(
        "", "file of a bearer token for the admin endpoints (/v1/status, /v1/peers, /v1/lookup), besides "
        "the token derived from the pool key", metavar="FILE")
    key_reload_seconds: float = setting(2.0, "seconds between re-reads of the key and token files "
                                        "(Secret volumes update in place)")
    tls_cert_file: str = setting("", "PEM certificate of this sidecar: TLS on the tcp data plane (with "
                                 "--tls-key-file and --tls-ca-file; '': plain TCP)", metavar="PEM")
    tls_key_file: str = setting("", "PEM private key of --tls-cert-file", metavar="PEM")
    tls_ca_file: str = setting("", "PEM CA bundle that signs every pool member's certificate", metavar="PEM")
    # Shared pool secret proving membership (read from pool_key_file); never sent, never logged.
    pool_key: bytes = field(default=b"", repr=False)
    # The pool's previous key (read from previous_pool_key_file), accepted while a rotation rolls out.
    previous_pool_key: bytes = field(default=b"", repr=False)
    # Admin token (read from admin_token_file) besides the pool-key token (b"" = none).
    admin_token: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.pool_key:
            raise ValueError("pool_key is empty: point --pool-key-file at the pool's Secret key file")
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all of --tls-cert-file, --tls-key-file and --tls-ca-file "
                             f"(got cert={self.tls_cert_file!r}, key={self.tls_key_file!r}, "
                             f"ca={self.tls_ca_file!r}): give all three or none")
        if self.key_reload_seconds <= 0:
            raise ValueError(f"key_reload_seconds must be positive, got {self.key_reload_seconds}")

    @property
    def tls_enabled(self) -> bool:
        """The TCP data plane runs TLS (mutual, with the pool's CA)."""
        return bool(self.tls_cert_file)


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """``settings.process``."""

    shutdown_grace_seconds: float = setting(3.0, "bound on finishing in-flight work at SIGTERM")


@dataclass(frozen=True, kw_only=True)
class SidecarSettings:
    """The settings of one sidecar, one field per group (``GROUPS``, in --help's order); the
    command's own flags (--ucx-tls, --parent-pid, --log-level) join data_plane and process."""

    pool: PoolSettings = group(
        PoolSettings, "what every sidecar of the pool shares: the operator's config file and the hash seed",
        required=True)
    network: NetworkSettings = group(NetworkSettings, "where this sidecar listens and who it is among its peers")
    store: StoreSettings = group(
        StoreSettings, "the host-memory chunk store: its budget, its file, what it keeps of fetched chunks")
    data_plane: DataPlaneSettings = group(
        DataPlaneSettings, "how chunks move between sidecars: the transport and the streams a fetch stripes over")
    peers: PeerSettings = group(
        PeerSettings, "how peers are found, how fresh their view of our chunks is, how long a fetch may take")
    recompute: RecomputeSettings = group(
        RecomputeSettings, "fetch or recompute: the engine's prefill rate a peer's run must beat")
    security: SecuritySettings = group(
        SecuritySettings, "pool membership, admin access and TLS on the tcp data plane", required=True)
    process: ProcessSettings = group(ProcessSettings, "the process's own life")

    def __post_init__(self) -> None:
        if self.security.tls_enabled and self.data_plane.transport != "tcp":
            raise ValueError(f"TLS encrypts the tcp data plane only, but transport is "
                             f"{self.data_plane.transport!r}: use --transport tcp with TLS, or leave the "
                             "--tls-* flags out (UCX traffic is not encrypted; protect it with the NetworkPolicy)")

    @classmethod
    def of(cls, **values: Any) -> SidecarSettings:
        """The settings from one keyword per setting of any group, e.g.
        ``SidecarSettings.of(config=c, pool_key=k, transport="tcp")`` (``setting_flags.grouped``)."""
        return grouped(cls, values)


# The flag groups of `kv-offload sidecar --help` and docs/reference/settings.md, from the fields above.
GROUPS: tuple[SettingGroup, ...] = setting_groups(SidecarSettings)
