"""Everything one sidecar process is configured with, in one frozen struct.

``main.py`` builds a ``SidecarSettings`` from flags, the environment and the
pool's ``OffloadingConfig``; the rest of the sidecar only reads it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from kv_offload_sidecar.engine import ports
from kv_offload_sidecar.engine.offloading_config import OffloadingConfig

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


@dataclass(frozen=True)
class SidecarSettings:
    # The pool's translated vLLM offloading config (fingerprint, chunk size).
    config: OffloadingConfig
    # Shared pool secret proving membership; never sent, never logged.
    pool_key: bytes = field(repr=False)
    # Address bound and advertised to peers (the routable pod IP in Kubernetes).
    host: str = ports.DEFAULT_HOST
    # Control port of global DP index 0; DP index i listens on base_port + i.
    base_port: int = ports.DEFAULT_BASE_PORT
    # Global data-parallel indices served by this pod, e.g. (0,) or (2, 3).
    dp_indices: tuple[int, ...] = (0,)
    # Data-plane port (TCP transport; 0 = any free port). UCX picks its own.
    data_port: int = DEFAULT_DATA_PORT
    # Byte budget of the host-memory chunk store (never exceeded).
    capacity_bytes: int = 1 << 30
    # Data plane: "ucx" (ucxx), "tcp" (plain asyncio sockets) or "nixl" (one-sided NIXL READs).
    transport: str = "tcp"
    # Directory of the shared-memory store file and local channel sockets.
    shm_dir: str = "/dev/shm"
    # Name of this sidecar among its peers (unique in the pool), e.g. the pod name.
    identity: str = ""
    # Static peers as "host:port" control addresses of their DP ports.
    static_peers: tuple[str, ...] = ()
    # DNS name of the pool's headless Service; "" when unused.
    peers_dns: str = ""
    # Seconds between DNS re-resolutions of peers_dns.
    dns_interval_seconds: float = 10.0
    # Seconds between publishes of this sidecar's chunk changes to their directory owners
    # (also how stale a location may be); e.g. 1.0.
    publish_interval_seconds: float = 1.0
    # Deadline of one peer lookup or fetch; late or failed means a miss.
    fetch_deadline_seconds: float = 2.0
    # Deadline of one handshake (both HTTP steps) with a peer.
    handshake_timeout_seconds: float = 5.0
    # First back-off delay after a peer failed; doubles up to backoff_max_seconds.
    backoff_initial_seconds: float = 0.5
    # Longest back-off delay of a failing or rejecting peer.
    backoff_max_seconds: float = 30.0
    # Bound on finishing in-flight work at shutdown (SIGTERM).
    shutdown_grace_seconds: float = 3.0
    # Prefix-hash seed compared in the handshake (see effective_hash_seed).
    hash_seed: str = DEFAULT_HASH_SEED
    # Largest accepted HTTP request body on the control ports, in bytes.
    max_body_bytes: int = 256 * 1024
    # File the pool key was read from, re-read every key_reload_seconds ("" = fixed key).
    pool_key_file: str = ""
    # The pool's previous key, accepted while a rotation rolls out (b"" = none).
    previous_pool_key: bytes = field(default=b"", repr=False)
    # File of the previous key; absent or empty means no rotation is under way.
    previous_pool_key_file: str = ""
    # Admin token for /v1/status, /v1/peers, /v1/lookup besides the pool-key token (b"" = none).
    admin_token: bytes = field(default=b"", repr=False)
    # File of the admin token, re-read with the keys ("" = none).
    admin_token_file: str = ""
    # Seconds between re-reads of the key and token files (Secret volumes update in place).
    key_reload_seconds: float = 2.0
    # Sharing policy for chunks fetched from peers once loaded (PEER_COPIES): "drop" or "cold".
    peer_copies: str = "drop"
    # The engine's prefill rate in prompt tokens per second, for fetch-or-recompute
    # (0 = always fetch); e.g. 10000.
    prefill_tokens_per_second: float = 0.0
    # vLLM's /metrics URL the prefill rate is learnt from, e.g. http://127.0.0.1:8000/metrics
    # ("" = the configured rate only).
    engine_metrics_url: str = ""
    # Seconds between scrapes of engine_metrics_url.
    engine_metrics_interval_seconds: float = 15.0
    # PEM certificate of this sidecar for TLS on the TCP data plane ("" = plain TCP).
    tls_cert_file: str = ""
    # PEM private key of tls_cert_file.
    tls_key_file: str = ""
    # PEM CA bundle that signs every pool member's certificate (peers are verified with it).
    tls_ca_file: str = ""

    def __post_init__(self) -> None:
        if not self.pool_key:
            raise ValueError("pool_key is empty: point --pool-key-file at the pool's Secret key file")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {list(TRANSPORTS)}")
        if not self.dp_indices or any(i < 0 for i in self.dp_indices):
            raise ValueError(f"dp_indices {self.dp_indices!r} must be non-negative global DP indices")
        if len(set(self.dp_indices)) != len(self.dp_indices):
            raise ValueError(f"dp_indices {self.dp_indices!r} repeat an index")
        if not 0 < self.base_port or self.base_port + max(self.dp_indices) > 65535:
            raise ValueError(
                f"base_port {self.base_port} + DP index {max(self.dp_indices)} is not a valid port")
        if not 0 <= self.data_port <= 65535:
            raise ValueError(f"data_port {self.data_port} is not a valid port (0-65535)")
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes {self.capacity_bytes} must be positive")
        for name in ("publish_interval_seconds", "fetch_deadline_seconds",
                     "handshake_timeout_seconds", "backoff_initial_seconds",
                     "dns_interval_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all of --tls-cert-file, --tls-key-file and --tls-ca-file "
                             f"(got cert={self.tls_cert_file!r}, key={self.tls_key_file!r}, "
                             f"ca={self.tls_ca_file!r}): give all three or none")
        if any(tls) and self.transport != "tcp":
            raise ValueError(f"TLS encrypts the tcp data plane only, but transport is {self.transport!r}: "
                             "use --transport tcp with TLS, or leave the --tls-* flags out "
                             "(UCX traffic is not encrypted; protect it with the NetworkPolicy)")
        if self.peer_copies not in PEER_COPIES:
            raise ValueError(f"peer_copies {self.peer_copies!r} is not one of {list(PEER_COPIES)}")
        if not self.prefill_tokens_per_second >= 0:
            raise ValueError(f"prefill_tokens_per_second {self.prefill_tokens_per_second} must be >= 0 "
                             "(the engine's prompt tokens per second; 0 always fetches)")
        if self.engine_metrics_url and not self.engine_metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-metrics-url {self.engine_metrics_url!r} must be an http(s) URL "
                             "of vLLM's /metrics, e.g. http://127.0.0.1:8000/metrics")
        if self.engine_metrics_interval_seconds <= 0:
            raise ValueError(f"engine_metrics_interval_seconds must be positive, "
                             f"got {self.engine_metrics_interval_seconds}")
        if self.key_reload_seconds <= 0:
            raise ValueError(f"key_reload_seconds must be positive, got {self.key_reload_seconds}")
        if not self.identity:
            object.__setattr__(self, "identity", default_identity(self.base_port))

    @property
    def tls_enabled(self) -> bool:
        """The TCP data plane runs TLS (mutual, with the pool's CA)."""
        return bool(self.tls_cert_file)

    @property
    def kv_bytes_per_chunk(self) -> int:
        """Bytes of one chunk (the store's slot size and the wire chunk size)."""
        return self.config.kv_bytes_per_chunk

    def control_port(self, dp_index: int) -> int:
        """The control port of a global DP index (``engine.ports.control_port``)."""
        return ports.control_port(self.base_port, dp_index)

    @property
    def control_ports(self) -> tuple[int, ...]:
        return tuple(self.control_port(i) for i in self.dp_indices)
