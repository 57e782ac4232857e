"""The ``KVOffloadPool`` API: its coordinates, and its spec read and defaulted.

Pure (no kopf, no I/O): ``SidecarSpec.from_pool`` turns a pool body's
``spec.sidecar``, ``spec.shmSizeLimit`` and ``spec.hashSeed`` into one frozen
value with every default applied, and refuses a value that can never work
with a ``ValueError`` naming the field and what to change. Both the pool's
own objects (``pool_objects``) and the pod patch (``pod_patch``) read it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.engine import ports
from kv_offload_sidecar.engine.offloading_config import OffloadingConfig
from kv_offload_sidecar.settings import DEFAULT_DATA_PORT, DEFAULT_HASH_SEED, TRANSPORTS

GROUP = "kv-offload.io"
VERSION = "v1alpha1"
PLURAL = "kvoffloadpools"
KIND = "KVOffloadPool"
# Label that puts a pod into a pool; its value is the pool name.
POOL_LABEL = "kv-offload.io/pool"
# The sidecar's own defaults (DEFAULT_DATA_PORT, DEFAULT_HASH_SEED and TRANSPORTS
# too, imported above): a pool that sets nothing runs the sidecar's defaults.
DEFAULT_BASE_PORT = ports.DEFAULT_BASE_PORT
DEFAULT_CAPACITY_BYTES = 4 << 30
# Head room of the default /dev/shm limit above the chunk store (vLLM, NCCL).
SHM_HEADROOM_BYTES = 1 << 30
DEFAULT_TRANSPORT = "ucx"
# Pool-wide PYTHONHASHSEED (spec.hashSeed): vLLM seeds its prefix hash chain
# (NONE_HASH) with it, randomly per process when it is unset.
HASH_SEED_ENV = "PYTHONHASHSEED"
# Largest PYTHONHASHSEED Python accepts (it refuses to start above it).
MAX_HASH_SEED = 4294967295
# Variables the operator sets on the sidecar itself -> the pool field to use instead.
_OPERATOR_SIDECAR_ENV: Mapping[str, str] = {ports.ENV_HOST: "spec.sidecar.basePort",
                                            ports.ENV_PORT: "spec.sidecar.basePort",
                                            HASH_SEED_ENV: "spec.hashSeed"}
DEFAULT_SIDECAR_RESOURCES: Mapping[str, Any] = {"requests": {"cpu": "250m", "memory": "256Mi"}}


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
    # PYTHONHASHSEED of every vLLM and sidecar container of the pool, e.g. "0".
    hash_seed: str = DEFAULT_HASH_SEED
    # Extra sidecar EnvVars (spec.sidecar.env); they override the UCX defaults.
    env: tuple[Mapping[str, Any], ...] = ()

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
        return cls(image=image, resources=sc.get("resources") or DEFAULT_SIDECAR_RESOURCES,
                   capacity_bytes=capacity, transport=transport, base_port=base_port,
                   data_port=DEFAULT_DATA_PORT, shm_size_limit=shm,
                   hash_seed=_hash_seed(spec.get("hashSeed", DEFAULT_HASH_SEED)),
                   env=_sidecar_env_spec(sc.get("env") or []))

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


def pool_hash_seed_problem(config: OffloadingConfig, hash_seed: str) -> str | None:
    """None unless the pool's kv_connector_extra_config names another hash seed.

    Sidecars state ``extra_config["hash_seed"]`` in the handshake before their
    ``PYTHONHASHSEED``, but vLLM seeds its prefix hashes with PYTHONHASHSEED
    (= spec.hashSeed), so a different stated seed would be a false claim.
    """
    stated = config.extra_config.get("hash_seed")
    if stated is None or str(stated) in ("", hash_seed):
        return None
    return (f"kv_connector_extra_config.hash_seed={stated!r} differs from spec.hashSeed {hash_seed!r}, the "
            f"PYTHONHASHSEED vLLM really seeds its prefix hashes with; remove hash_seed from "
            f"kv_connector_extra_config or set spec.hashSeed: {str(stated)!r}")
