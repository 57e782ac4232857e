"""The ``KVOffloadPool`` API: its coordinates, and its spec read and defaulted.

Pure (no kopf, no I/O): ``SidecarSpec.from_pool`` turns a pool body's
``spec.sidecar``, ``spec.shmSizeLimit`` and ``spec.hashSeed`` into one frozen
value with every default applied, and refuses a value that can never work
with a ``ValueError`` naming the field and what to change. Both the pool's
own objects (``pool_objects``) and the pod patch (``pod_patch``) read it.
``key_rotation_grace_seconds`` reads ``spec.keyRotationGraceSeconds`` the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.engine import ports
from kv_offload_sidecar.engine.offloading_config import OffloadingConfig
from kv_offload_sidecar.settings import DEFAULT_DATA_PORT, TRANSPORTS

GROUP = "kv-offload.io"
VERSION = "v1alpha1"
PLURAL = "kvoffloadpools"
KIND = "KVOffloadPool"
# Label that puts a pod into a pool; its value is the pool name.
POOL_LABEL = "kv-offload.io/pool"
# The sidecar's own defaults (DEFAULT_DATA_PORT and TRANSPORTS too, imported
# above): a pool that sets nothing runs the sidecar's defaults.
DEFAULT_BASE_PORT = ports.DEFAULT_BASE_PORT
DEFAULT_CAPACITY_BYTES = 4 << 30
# Head room of the default /dev/shm limit above the chunk store (vLLM, NCCL).
SHM_HEADROOM_BYTES = 1 << 30
DEFAULT_TRANSPORT = "ucx"
# Pool-wide PYTHONHASHSEED: vLLM seeds its prefix hash chain (NONE_HASH) with it,
# randomly per process when it is unset. spec.hashSeed fixes it; without it the
# pool's secret seed (Secret <pool>-pool-key, key hash-seed) is used.
HASH_SEED_ENV = "PYTHONHASHSEED"
# Largest PYTHONHASHSEED Python accepts (it refuses to start above it).
MAX_HASH_SEED = 4294967295
# Variables the operator sets on the sidecar itself -> the pool field to use instead.
_OPERATOR_SIDECAR_ENV: Mapping[str, str] = {ports.ENV_HOST: "spec.sidecar.basePort",
                                            ports.ENV_PORT: "spec.sidecar.basePort",
                                            HASH_SEED_ENV: "spec.hashSeed"}
DEFAULT_SIDECAR_RESOURCES: Mapping[str, Any] = {"requests": {"cpu": "250m", "memory": "256Mi"}}
# Seconds a rotated-out pool key stays accepted (spec.keyRotationGraceSeconds).
DEFAULT_KEY_ROTATION_GRACE_SECONDS = 600


class PoolSpecError(ValueError):
    """A pool spec that can never work; its message says what to change."""


@dataclass(frozen=True)
class SidecarSpec:
    """The defaulted ``spec.sidecar``, ``spec.shmSizeLimit`` and ``spec.hashSeed`` of one pool."""

    # Sidecar image (spec.sidecar.image, else the operator's --sidecar-image).
    image: str
    # ResourceRequirements of the sidecar container.
    resources: Mapping[str, Any]
    # Host-memory chunk store size per pod in bytes (> 0).
    capacity_bytes: int
    # Data plane between peers: "ucx" or "tcp".
    transport: str
    # Control port of global DP rank 0; rank i uses base_port + i.
    base_port: int
    # Data-plane port of the TCP transport.
    data_port: int
    # sizeLimit of the shared /dev/shm emptyDir (quantity string or bytes).
    shm_size_limit: str | int
    # Fixed PYTHONHASHSEED of every vLLM and sidecar container (spec.hashSeed), e.g. "0";
    # None: the pool's secret seed, read from its Secret by the containers.
    hash_seed: str | None = None
    # Extra sidecar EnvVars (spec.sidecar.env); they override the UCX defaults.
    env: tuple[Mapping[str, Any], ...] = ()
    # Secret with tls.crt, tls.key and ca.crt for the tcp data plane (spec.sidecar.tls.secretName); None: no TLS.
    tls_secret: str | None = None

    @classmethod
    def from_pool(cls, pool: Mapping[str, Any], *, default_image: str) -> "SidecarSpec":
        """Read a pool body's spec; ValueError names the field and what to change."""
        spec = pool.get("spec") or {}
        sc = spec.get("sidecar") or {}
        image = sc.get("image") or default_image
        if not image:
            raise ValueError("spec.sidecar.image is empty and the operator has no --sidecar-image; "
                             "set spec.sidecar.image")
        capacity = sc.get("capacityBytes", DEFAULT_CAPACITY_BYTES)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"spec.sidecar.capacityBytes={capacity!r}: set a positive number of bytes")
        transport = sc.get("transport", DEFAULT_TRANSPORT)
        if transport not in TRANSPORTS:
            raise ValueError(f"spec.sidecar.transport={transport!r}: use one of {list(TRANSPORTS)}")
        base_port = sc.get("basePort", DEFAULT_BASE_PORT)
        if not isinstance(base_port, int) or isinstance(base_port, bool) or not 1 <= base_port <= 65000:
            raise ValueError(f"spec.sidecar.basePort={base_port!r}: use a port in [1, 65000]")
        shm = spec.get("shmSizeLimit", capacity + SHM_HEADROOM_BYTES)
        seed = spec.get("hashSeed")
        return cls(image=image, resources=sc.get("resources") or DEFAULT_SIDECAR_RESOURCES,
                   capacity_bytes=capacity, transport=transport, base_port=base_port,
                   data_port=DEFAULT_DATA_PORT, shm_size_limit=shm,
                   hash_seed=None if seed is None else _hash_seed(seed),
                   env=_sidecar_env_spec(sc.get("env") or []),
                   tls_secret=_tls_secret(sc.get("tls"), transport))

    def control_port(self, dp_index: int) -> int:
        """The sidecar's control port of global data-parallel index ``dp_index`` (the sidecar's
        own rule, ``engine.ports.control_port``); ValueError naming spec.sidecar.basePort."""
        try:
            return ports.control_port(self.base_port, dp_index)
        except ValueError:
            raise ValueError(f"spec.sidecar.basePort={self.base_port} + data-parallel index {dp_index} "
                             f"is above port 65535: set a lower spec.sidecar.basePort") from None


def _hash_seed(value: Any) -> str:
    """spec.hashSeed as PYTHONHASHSEED accepts it: a decimal in [0, 4294967295]."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if not (text.isascii() and text.isdigit() and int(text) <= MAX_HASH_SEED):
        raise ValueError(f"spec.hashSeed={value!r}: use a decimal integer in [0, {MAX_HASH_SEED}] "
                         f"as a string, e.g. \"0\" (it becomes PYTHONHASHSEED)")
    return text


def _tls_secret(tls: Any, transport: str) -> str | None:
    """spec.sidecar.tls.secretName, refused with the UCX transport (which it cannot encrypt)."""
    if tls is None:
        return None
    name = tls.get("secretName") if isinstance(tls, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"spec.sidecar.tls={tls!r} names no Secret: set spec.sidecar.tls.secretName to a Secret "
                         f"with tls.crt, tls.key and ca.crt (a cert-manager Certificate's Secret), or remove "
                         f"spec.sidecar.tls")
    if transport != "tcp":
        raise ValueError(f"spec.sidecar.tls.secretName={name!r} is set but spec.sidecar.transport is "
                         f"{transport!r}: TLS applies to the tcp transport only and UCX traffic is not "
                         f"encrypted; set spec.sidecar.transport: tcp, or remove spec.sidecar.tls and keep "
                         f"UCX traffic inside the pool with the NetworkPolicy")
    return name


def key_rotation_grace_seconds(pool: Mapping[str, Any]) -> int:
    """spec.keyRotationGraceSeconds: how long a rotated-out pool key stays accepted.

    The operator only needs a positive number; the CRD asks for at least 60
    (a mounted Secret reaches every pod within about a minute)."""
    value = (pool.get("spec") or {}).get("keyRotationGraceSeconds", DEFAULT_KEY_ROTATION_GRACE_SECONDS)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"spec.keyRotationGraceSeconds={value!r}: use a whole number of seconds, at least 60 "
                         f"(default {DEFAULT_KEY_ROTATION_GRACE_SECONDS})")
    return value


def _sidecar_env_spec(env: Any) -> tuple[Mapping[str, Any], ...]:
    """spec.sidecar.env checked entry by entry; ValueError names the entry."""
    if not isinstance(env, list):
        raise ValueError("spec.sidecar.env must be a list of EnvVars ({name, value} or {name, valueFrom})")
    names: set[str] = set()
    for i, item in enumerate(env):
        name = item.get("name") if isinstance(item, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"spec.sidecar.env[{i}] has no name: give each entry a name and a value")
        if name in _OPERATOR_SIDECAR_ENV:
            raise ValueError(f"spec.sidecar.env[{i}] sets {name}, which the operator sets itself: "
                             f"remove it and use {_OPERATOR_SIDECAR_ENV[name]} instead")
        if name in names:
            raise ValueError(f"spec.sidecar.env[{i}] repeats {name}: keep one entry per name")
        names.add(name)
        if ("value" in item) == ("valueFrom" in item) or not isinstance(item.get("value", ""), str):
            raise ValueError(f"spec.sidecar.env[{i}] ({name}) needs exactly one of a string value or valueFrom")
    return tuple(copy.deepcopy(dict(item)) for item in env)


def pool_hash_seed_problem(config: OffloadingConfig, hash_seed: str | None) -> str | None:
    """None unless the pool's kv_connector_extra_config names a hash seed vLLM does not use.

    Sidecars state ``extra_config["hash_seed"]`` in the handshake before their
    ``PYTHONHASHSEED`` (``settings.effective_hash_seed``), but vLLM seeds its
    prefix hashes with PYTHONHASHSEED: spec.hashSeed, or the pool's secret
    seed when ``hash_seed`` is None. A stated seed other than spec.hashSeed
    would be a false claim, and any stated seed beside a secret one would be
    false and would print the seed into the pool's ConfigMap.
    """
    stated = config.extra_config.get("hash_seed")
    if stated is None or str(stated) == "" or str(stated) == hash_seed:
        return None
    if hash_seed is None:
        return (f"kv_connector_extra_config.hash_seed={stated!r} is set but spec.hashSeed is not, so vLLM seeds "
                f"its prefix hashes with the pool's secret seed (Secret <pool>-pool-key, key hash-seed); remove "
                f"hash_seed from kv_connector_extra_config, or set spec.hashSeed: {str(stated)!r} for a fixed seed")
    return (f"kv_connector_extra_config.hash_seed={stated!r} differs from spec.hashSeed {hash_seed!r}, the "
            f"PYTHONHASHSEED vLLM really seeds its prefix hashes with; remove hash_seed from "
            f"kv_connector_extra_config or set spec.hashSeed: {str(stated)!r}")
