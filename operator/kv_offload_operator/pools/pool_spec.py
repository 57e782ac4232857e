"""The ``KVOffloadPool`` API: its coordinates, and its spec read and defaulted.

Pure (no kopf, no I/O): ``SidecarSpec.from_pool`` turns a pool body's
``spec.sidecar``, ``spec.shmSizeLimit`` and ``spec.hashSeed`` into one frozen
value with every default applied, and refuses a value that can never work
with a ``ValueError`` naming the field, the value and what to change. Both
the pool's own objects (``pool_objects``) and the pod patch (``pod_patch``)
read it. ``prefillTokensPerSecond`` and ``peerCopies`` (the sidecar's
fetch-or-recompute rate and sharing policy) default to the operator's
--sidecar-prefill-tokens-per-second / --sidecar-peer-copies, as the ports do.
Sizes (``capacityBytes``, ``shmSizeLimit``, memory) are bytes or
Kubernetes quantities (``quantity.parse_bytes``). The sidecar's memory
request covers its store: the store fills ``capacityBytes`` of /dev/shm at
start and those pages are charged to the sidecar container.
``key_rotation_grace_seconds`` reads ``spec.keyRotationGraceSeconds`` the same way.

The data plane is one setting, ``spec.sidecar.dataPlane``: ``transport`` (a ``TRANSPORTS``
value) and ``lanes`` (the parallel streams one fetch stripes over, the sidecar's ``--lanes``,
which each plane maps: tcp connections, nixl read threads, ucx 1 or 2 connections; 0: one per
core of the sidecar's CPU budget). Unset, the transport is tcp with ``spec.sidecar.tls``, ucx
with ``spec.sidecar.rdma``, else the webhook picks per pod (``pod_defaults``): the measured
``GPU_TRANSPORT`` beside a GPU, else ``DEFAULT_TRANSPORT``. The older ``spec.sidecar.transport``
is still read, with a ``Deprecated`` condition (``deprecation_conditions``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.cpu_budget import CPU_REQUEST_ENV
from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.setting_flags import field_default
from kv_offload_sidecar.settings import (
    DEFAULT_DATA_PORT,
    MAX_DATA_LANES,
    PEER_COPIES,
    TRANSPORTS,
    SidecarSettings,
)

from ..quantity import format_bytes, parse_bytes, positive_bytes

GROUP = "kv-offload.io"
VERSION = "v1alpha1"
PLURAL = "kvoffloadpools"
KIND = "KVOffloadPool"
# Label that puts a pod into a pool; its value is the pool name.
POOL_LABEL = "kv-offload.io/pool"
# A pool that sets nothing runs the sidecar's own defaults, read from SidecarSettings
# (DEFAULT_DATA_PORT, TRANSPORTS and PEER_COPIES too, imported above).
DEFAULT_BASE_PORT = field_default(SidecarSettings, "base_port")
DEFAULT_TRANSPORT = field_default(SidecarSettings, "transport")
# 0: one lane per core of the sidecar's CPU budget (``cpu_budget``), at most MAX_DATA_LANES.
DEFAULT_LANES = field_default(SidecarSettings, "lanes")
# The transport of a pod whose vLLM container requests a GPU, where the pool names none: the
# only plane measured on a GPU (``bench gpu`` on an H200, Llama-3.1-8B, docs/how-to/size-a-gpu-pool.md:
# 16K tokens recomputed in 594 ms, fetched over tcp with 8 lanes in 204 ms); ucx was never
# measured there. Its lanes stay DEFAULT_LANES: one per core of GPU_SIDECAR_CPU.
GPU_TRANSPORT = "tcp"
# The condition type (and reason) of a pool that still uses a deprecated field.
DEPRECATED_CONDITION = "Deprecated"
# 0.0 = always fetch from peers.
DEFAULT_PREFILL_TOKENS_PER_SECOND = field_default(SidecarSettings, "prefill_tokens_per_second")
# "drop": drop a peer's chunk once the engine loaded it.
DEFAULT_PEER_COPIES = field_default(SidecarSettings, "peer_copies")
# The image a pool runs when neither spec.sidecar.image nor the operator's --sidecar-image
# (nor $KV_OFFLOAD_SIDECAR_IMAGE) names one: none. No public registry holds the image; the
# chart passes its own image (image.repository:tag) as --sidecar-image, and a pool of an
# operator started without one is refused with a message saying so.
DEFAULT_SIDECAR_IMAGE = ""
# Unlike a bare sidecar's 1 GiB (a developer's host), a pool's store is sized for a GPU node.
DEFAULT_CAPACITY_BYTES = 4 << 30
# Head room of the default /dev/shm limit above the chunk store and vLLM's
# primary tier (NCCL, PyTorch's shared tensors, vLLM's own IPC).
SHM_HEADROOM_BYTES = 1 << 30
# Memory of the sidecar process besides its store (Python, aiohttp, UCX buffers).
SIDECAR_MEMORY_OVERHEAD_BYTES = 256 << 20
# UCX_TLS of each spec.sidecar.ucxTransports preset. UCX picks per peer among the
# listed transports: sm reaches peers on the same node whose pods share the host's
# PID and IPC namespaces (hostPID and hostIPC), rc/dc peers on an RDMA fabric, tcp
# everything else (the fallback of the RDMA presets).
UCX_TRANSPORT_PRESETS: Mapping[str, str] = {
    "tcp-sm": "tcp,sm,self", "tcp": "tcp,self", "rdma-rc": "rc,sm,self,tcp", "rdma-dc": "dc,sm,self,tcp"}
DEFAULT_UCX_TRANSPORTS = "tcp-sm"
# Pool-wide PYTHONHASHSEED: vLLM seeds its prefix hash chain (NONE_HASH) with it,
# randomly per process when it is unset. spec.hashSeed fixes it; without it the
# pool's secret seed (Secret <pool>-pool-key, key hash-seed) is used.
HASH_SEED_ENV = "PYTHONHASHSEED"
# Largest PYTHONHASHSEED Python accepts (it refuses to start above it).
MAX_HASH_SEED = 4294967295
# Variables the operator sets on the sidecar itself -> the pool field to use instead.
_OPERATOR_SIDECAR_ENV: Mapping[str, str] = {ports.ENV_HOST: "spec.sidecar.basePort",
                                            ports.ENV_PORT: "spec.sidecar.basePort",
                                            HASH_SEED_ENV: "spec.hashSeed",
                                            CPU_REQUEST_ENV: "spec.sidecar.resources.requests.cpu"}
DEFAULT_SIDECAR_CPU = "250m"
# The sidecar's CPU request in a pod whose vLLM container requests a GPU (lanes follow the
# sidecar's cores, ``cpu_budget``). From bench gpu on an H200 (Llama-3.1-8B, tcp; docs/
# benchmarks.md "CPUs per GPU pod"): with 1 lane a peer hit loses to recompute (0.64x at 2K
# tokens, 0.80x at 16K), with 4 it wins (1.47x, 2.06x), the fetcher busy on 3.3-3.6 cores.
GPU_SIDECAR_CPU = "4"
# Seconds a rotated-out pool key stays accepted (spec.keyRotationGraceSeconds).
DEFAULT_KEY_ROTATION_GRACE_SECONDS = 600


class PoolSpecError(ValueError):
    """A pool spec that can never work; its message says what to change."""


@dataclass(frozen=True)
class SidecarSpec:
    """The defaulted ``spec.sidecar``, ``spec.shmSizeLimit`` and ``spec.hashSeed`` of one pool."""

    # Sidecar image (spec.sidecar.image, else the operator's --sidecar-image).
    image: str
    # ResourceRequirements of the sidecar container: the memory request covers the
    # store (capacity_bytes + SIDECAR_MEMORY_OVERHEAD_BYTES), RDMA devices are added.
    resources: Mapping[str, Any]
    # Host-memory chunk store size per pod in bytes (> 0).
    capacity_bytes: int
    # Data plane between peers (spec.sidecar.dataPlane.transport): "ucx", "tcp" or "nixl"
    # (one-sided NIXL reads; requests on a tcp connection to data_port).
    transport: str
    # Control port of global DP rank 0; rank i uses base_port + i.
    base_port: int
    # Data-plane port of the tcp and nixl transports (spec.sidecar.dataPort).
    data_port: int
    # sizeLimit of the shared /dev/shm emptyDir in bytes (spec.shmSizeLimit); None: each pod's
    # store + vLLM's primary tier + SHM_HEADROOM_BYTES (pod_patch.shm_bytes_needed).
    shm_size_limit: int | None
    # Fixed PYTHONHASHSEED of every vLLM and sidecar container (spec.hashSeed), e.g. "0";
    # None: the pool's secret seed, read from its Secret by the containers.
    hash_seed: str | None = None
    # Extra sidecar EnvVars (spec.sidecar.env); they override the UCX defaults.
    env: tuple[Mapping[str, Any], ...] = ()
    # Secret with tls.crt, tls.key and ca.crt for the tcp data plane (spec.sidecar.tls.secretName); None: no TLS.
    tls_secret: str | None = None
    # spec.sidecar.ucxTransports: a key of UCX_TRANSPORT_PRESETS, the sidecar's UCX_TLS.
    ucx_transports: str = DEFAULT_UCX_TRANSPORTS
    # DRA claims of the sidecar (spec.sidecar.rdma.resourceClaims): PodResourceClaims, each
    # optionally with the "request" the sidecar uses.
    resource_claims: tuple[Mapping[str, Any], ...] = ()
    # spec.sidecar.rdma.ipcLock: the sidecar runs as UID 0 with every capability dropped but
    # IPC_LOCK, so it may pin (register) memory beyond RLIMIT_MEMLOCK (Kubernetes gives added
    # capabilities to root processes only).
    ipc_lock: bool = False
    # The engine's prefill rate in prompt tokens per second (spec.sidecar.prefillTokensPerSecond,
    # else the operator's --sidecar-prefill-tokens-per-second), e.g. 12500.0: a peer's run slower
    # to fetch than to recompute at this rate is a miss; 0.0 always fetches.
    prefill_tokens_per_second: float = DEFAULT_PREFILL_TOKENS_PER_SECOND
    # What a sidecar keeps of a chunk fetched from a peer once the engine loaded it
    # (spec.sidecar.peerCopies, else the operator's --sidecar-peer-copies): a PEER_COPIES value,
    # "drop" (one copy per chunk in the pool) or "cold" (a copy at the cold end of the store).
    peer_copies: str = DEFAULT_PEER_COPIES
    # vLLM's /metrics URL the sidecar learns the prefill rate from (spec.sidecar.engineMetricsURL),
    # e.g. "http://127.0.0.1:8000/metrics"; "" = the vLLM container's own (``pod_defaults``).
    engine_metrics_url: str = ""
    # spec.sidecar.resources was given: its CPU request stands; False = the operator's
    # (DEFAULT_SIDECAR_CPU, or GPU_SIDECAR_CPU beside a GPU: ``pod_defaults``).
    resources_given: bool = False
    # Parallel streams one fetch stripes over (spec.sidecar.dataPlane.lanes, the sidecar's
    # --lanes), e.g. 4; 0 = one per core of the sidecar's CPU budget.
    lanes: int = DEFAULT_LANES
    # The pool chose the transport (dataPlane.transport, the deprecated spec.sidecar.transport,
    # or tls/rdma, which need tcp/ucx); False = the pod's (GPU_TRANSPORT beside a GPU).
    transport_given: bool = False
    # One message per deprecated field the pool uses, e.g. "spec.sidecar.transport is deprecated: ...".
    deprecations: tuple[str, ...] = ()

    @property
    def ucx_tls(self) -> str:
        """The UCX_TLS of ``ucx_transports`` (spec.sidecar.env UCX_TLS still wins in the pod)."""
        return UCX_TRANSPORT_PRESETS[self.ucx_transports]

    @classmethod
    def with_operator_defaults(cls, pool: Mapping[str, Any], options: Any) -> SidecarSpec:
        """``from_pool`` with the operator's ``--sidecar-*`` flags (an ``OperatorOptions``) as
        the defaults."""
        return cls.from_pool(pool, default_image=options.sidecar_image,
                             default_base_port=options.sidecar_base_port,
                             default_data_port=options.sidecar_data_port,
                             default_prefill_tokens_per_second=options.sidecar_prefill_tokens_per_second,
                             default_peer_copies=options.sidecar_peer_copies,
                             default_transport=options.sidecar_transport,
                             default_lanes=options.sidecar_lanes)

    @classmethod
    def from_pool(cls, pool: Mapping[str, Any], *, default_image: str, default_base_port: int = DEFAULT_BASE_PORT,
                  default_data_port: int = DEFAULT_DATA_PORT,
                  default_prefill_tokens_per_second: float = DEFAULT_PREFILL_TOKENS_PER_SECOND,
                  default_peer_copies: str = DEFAULT_PEER_COPIES, default_transport: str = "",
                  default_lanes: int = DEFAULT_LANES) -> SidecarSpec:
        """Read a pool body's spec; ValueError names the field, the value and what to change.

        ``default_*``: what a pool that sets no image, basePort, dataPort,
        prefillTokensPerSecond, peerCopies or dataPlane gets (the operator's --sidecar-*
        flags; the chart's sidecar.* values; ``default_transport`` "": the pod's)."""
        spec = pool.get("spec") or {}
        sc = spec.get("sidecar") or {}
        image = sc.get("image") or default_image
        if not image:
            raise ValueError("spec.sidecar.image is empty and the operator has no --sidecar-image "
                             "(nor $KV_OFFLOAD_SIDECAR_IMAGE): set spec.sidecar.image, or install the "
                             "operator with the chart, which passes its own image as --sidecar-image")
        capacity = positive_bytes(sc.get("capacityBytes", DEFAULT_CAPACITY_BYTES), "spec.sidecar.capacityBytes")
        transport, lanes, transport_given, deprecations = _data_plane(sc, default_transport, default_lanes)
        base_port = sc.get("basePort", default_base_port)
        if not isinstance(base_port, int) or isinstance(base_port, bool) or not 1 <= base_port <= 65000:
            raise ValueError(f"spec.sidecar.basePort={base_port!r}: use a port in [1, 65000]")
        data_port = sc.get("dataPort", default_data_port)
        if not isinstance(data_port, int) or isinstance(data_port, bool) or not 1 <= data_port <= 65535:
            raise ValueError(f"spec.sidecar.dataPort={data_port!r}: use a port in [1, 65535]")
        if data_port == base_port:
            raise ValueError(f"spec.sidecar.dataPort={data_port} equals spec.sidecar.basePort, the control port "
                             f"of data-parallel rank 0: pick another spec.sidecar.dataPort")
        shm = spec.get("shmSizeLimit")
        shm_bytes = None if shm is None else positive_bytes(shm, "spec.shmSizeLimit")
        if shm_bytes is not None and shm_bytes < capacity:
            raise ValueError(f"spec.shmSizeLimit={shm!r} ({format_bytes(shm_bytes)}) is smaller than "
                             f"spec.sidecar.capacityBytes ({format_bytes(capacity)}), which the store fills in "
                             f"/dev/shm at start: raise spec.shmSizeLimit above capacityBytes plus vLLM's "
                             f"cpu_bytes_to_use, or remove it to get that default")
        ucx_transports = sc.get("ucxTransports", DEFAULT_UCX_TRANSPORTS)
        if ucx_transports not in UCX_TRANSPORT_PRESETS:
            raise ValueError(f"spec.sidecar.ucxTransports={ucx_transports!r}: use one of "
                             f"{list(UCX_TRANSPORT_PRESETS)}")
        rdma = _rdma(sc.get("rdma"), transport, ucx_transports)
        prefill = _prefill_tokens_per_second(sc.get("prefillTokensPerSecond", default_prefill_tokens_per_second))
        peer_copies = sc.get("peerCopies", default_peer_copies)
        if not isinstance(peer_copies, str) or peer_copies not in PEER_COPIES:
            raise ValueError(f"spec.sidecar.peerCopies={peer_copies!r}: use one of {list(PEER_COPIES)} (drop: the "
                             f"pool keeps one copy of each chunk; cold: the fetching sidecar keeps a copy at the "
                             f"cold end of its store)")
        metrics_url = sc.get("engineMetricsURL", "")
        if not isinstance(metrics_url, str) or (metrics_url and not metrics_url.startswith(("http://", "https://"))):
            raise ValueError(f"spec.sidecar.engineMetricsURL={metrics_url!r}: use the http(s) URL of the vLLM "
                             f"container's /metrics as the sidecar reaches it, e.g. http://127.0.0.1:8000/metrics, "
                             f"or leave it unset")
        seed = spec.get("hashSeed")
        return cls(image=image,
                   resources=_sidecar_resources(sc.get("resources"), capacity, rdma["resources"]),
                   capacity_bytes=capacity, transport=transport, base_port=base_port,
                   data_port=data_port, shm_size_limit=shm_bytes,
                   hash_seed=None if seed is None else _hash_seed(seed),
                   env=_sidecar_env_spec(sc.get("env") or []),
                   tls_secret=_tls_secret(sc.get("tls"), transport),
                   ucx_transports=ucx_transports, resource_claims=rdma["claims"],
                   ipc_lock=rdma["ipc_lock"], prefill_tokens_per_second=prefill, peer_copies=peer_copies,
                   engine_metrics_url=metrics_url, resources_given=bool(sc.get("resources")),
                   lanes=lanes, transport_given=transport_given, deprecations=deprecations)

    def control_port(self, dp_index: int) -> int:
        """The sidecar's control port of global data-parallel index ``dp_index`` (the sidecar's
        own rule, ``engine.contract.ports.control_port``); ValueError naming spec.sidecar.basePort."""
        try:
            return ports.control_port(self.base_port, dp_index)
        except ValueError:
            raise ValueError(f"spec.sidecar.basePort={self.base_port} + data-parallel index {dp_index} "
                             f"is above port 65535: set a lower spec.sidecar.basePort") from None

    def check_ports(self, dp_size: int) -> None:
        """ValueError when the data port lies among the control ports of ``dp_size`` DP ranks."""
        last = self.control_port(max(1, dp_size) - 1)
        if self.base_port <= self.data_port <= last:
            raise ValueError(f"spec.sidecar.dataPort={self.data_port} lies among the control ports "
                             f"{self.base_port}-{last} (spec.sidecar.basePort + data-parallel index, "
                             f"{dp_size} ranks): move spec.sidecar.dataPort out of that range")


def _sidecar_resources(resources: Any, capacity: int, devices: Mapping[str, str]) -> dict[str, Any]:
    """spec.sidecar.resources with a memory request that holds the store, and the RDMA devices.

    No memory request: capacity + SIDECAR_MEMORY_OVERHEAD_BYTES is requested (the
    store's pages are charged to the sidecar). A request or limit below that is
    refused: the scheduler would place the pod where its store does not fit, or the
    kernel would kill the sidecar while it fills the store.
    """
    if resources is None:
        resources = {}
    if not isinstance(resources, Mapping):
        raise ValueError(f"spec.sidecar.resources={resources!r} must be a ResourceRequirements object")
    result = copy.deepcopy(dict(resources))
    need = capacity + SIDECAR_MEMORY_OVERHEAD_BYTES
    for kind in ("requests", "limits"):
        given = (result.get(kind) or {}).get("memory")
        if given is None:
            continue
        have = parse_bytes(given, f"spec.sidecar.resources.{kind}.memory")
        if have < need:
            raise ValueError(
                f"spec.sidecar.resources.{kind}.memory={given!r} is below the store it holds: "
                f"spec.sidecar.capacityBytes ({format_bytes(capacity)}) + "
                f"{format_bytes(SIDECAR_MEMORY_OVERHEAD_BYTES)} "
                f"for the process = {format_bytes(need)}; raise it to at least {format_bytes(need)} or lower "
                f"spec.sidecar.capacityBytes")
    requests = dict(result.get("requests") or {})
    limits = dict(result.get("limits") or {})
    if "memory" not in requests and "memory" not in limits:
        requests["memory"] = format_bytes(need)
    if not resources:
        requests.setdefault("cpu", DEFAULT_SIDECAR_CPU)
    for name, count in devices.items():  # extended resources: request = limit
        requests[name] = limits[name] = count
    if requests:
        result["requests"] = requests
    if limits:
        result["limits"] = limits
    return result


def _data_plane(sc: Mapping[str, Any], default_transport: str = "",
                default_lanes: int = DEFAULT_LANES) -> tuple[str, int, bool, tuple[str, ...]]:
    """spec.sidecar.dataPlane (and the deprecated spec.sidecar.transport): the transport, the
    lanes, whether the pool (or the operator's --sidecar-transport) chose the transport, and the
    deprecation messages."""
    plane = sc.get("dataPlane")
    if plane is None:
        plane = {}
    if not isinstance(plane, Mapping):
        raise ValueError(f"spec.sidecar.dataPlane={plane!r} must be an object (transport, lanes)")
    old, new = sc.get("transport"), plane.get("transport")
    deprecations: tuple[str, ...] = ()
    if old is not None:
        if new is not None and new != old:
            raise ValueError(f"spec.sidecar.transport={old!r} (deprecated) and spec.sidecar.dataPlane.transport="
                             f"{new!r} disagree: remove spec.sidecar.transport and keep dataPlane.transport")
        deprecations = (f"spec.sidecar.transport is deprecated: move it to spec.sidecar.dataPlane.transport "
                        f"({old!r}); it is still read",)
    transport = new if new is not None else old
    given = transport is not None
    if transport is None:  # what tls and rdma need, the operator's default, else the pod's (pod_defaults)
        needed = "tcp" if sc.get("tls") is not None else "ucx" if sc.get("rdma") is not None else None
        transport = needed or default_transport or DEFAULT_TRANSPORT
        given = bool(needed or default_transport)
    field = "spec.sidecar.dataPlane.transport" if new is not None or old is None else "spec.sidecar.transport"
    if transport not in TRANSPORTS:
        raise ValueError(f"{field}={transport!r}: use one of {list(TRANSPORTS)}")
    lanes = plane.get("lanes", default_lanes)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 0 <= lanes <= MAX_DATA_LANES:
        raise ValueError(f"spec.sidecar.dataPlane.lanes={lanes!r}: use 0 (one per core of the sidecar's CPU "
                         f"budget) or 1-{MAX_DATA_LANES}, the parallel streams one fetch stripes over")
    return transport, lanes, given, deprecations


def deprecation_conditions(sidecar: SidecarSpec, old: Sequence[Mapping[str, Any]] | None,
                           generation: int | None, now: str) -> list[dict[str, Any]]:
    """The pool's ``Deprecated`` condition: True naming each deprecated field it uses, absent
    when it uses none. ``lastTransitionTime`` moves only when the message changes."""
    if not sidecar.deprecations:
        return []
    message = "; ".join(sidecar.deprecations)
    before = next((c for c in old or [] if c.get("type") == DEPRECATED_CONDITION), {})
    since = before.get("lastTransitionTime") if before.get("message") == message else None
    cond: dict[str, Any] = {"type": DEPRECATED_CONDITION, "status": "True", "reason": "DeprecatedField",
                            "message": message, "lastTransitionTime": since or now}
    if generation is not None:
        cond["observedGeneration"] = generation
    return [cond]


def _rdma(rdma: Any, transport: str, ucx_transports: str) -> dict[str, Any]:
    """spec.sidecar.rdma: device-plugin resources, DRA claims and IPC_LOCK, checked."""
    if rdma is None:
        return {"resources": {}, "claims": (), "ipc_lock": False}
    if not isinstance(rdma, Mapping):
        raise ValueError(f"spec.sidecar.rdma={rdma!r} must be an object (resources, resourceClaims, ipcLock)")
    if transport != "ucx":
        raise ValueError(f"spec.sidecar.rdma is set but spec.sidecar.dataPlane.transport is {transport!r}: RDMA "
                         f"needs the ucx transport; set spec.sidecar.dataPlane.transport: ucx or remove "
                         f"spec.sidecar.rdma")
    if not ucx_transports.startswith("rdma-"):
        raise ValueError(f"spec.sidecar.rdma is set but spec.sidecar.ucxTransports is {ucx_transports!r}, which "
                         f"lists no RDMA transport: set spec.sidecar.ucxTransports: rdma-rc (or rdma-dc on "
                         f"ConnectX), or remove spec.sidecar.rdma")
    devices: dict[str, str] = {}
    for name, count in (rdma.get("resources") or {}).items():
        if "/" not in str(name):
            raise ValueError(f"spec.sidecar.rdma.resources names {name!r}: give a device-plugin resource with "
                             f"its domain, e.g. rdma/ib or rdma/hca_shared_devices_a")
        if isinstance(count, bool) or not isinstance(count, (int, str)) or not str(count).isdigit() \
                or int(count) < 1:
            raise ValueError(f"spec.sidecar.rdma.resources.{name}={count!r}: give a whole number of devices, e.g. 1")
        devices[str(name)] = str(count)
    claims = []
    for i, claim in enumerate(rdma.get("resourceClaims") or []):
        name = claim.get("name") if isinstance(claim, Mapping) else None
        sources = [k for k in ("resourceClaimName", "resourceClaimTemplateName") if claim.get(k)] \
            if isinstance(claim, Mapping) else []
        if not isinstance(name, str) or not name or len(sources) != 1:
            raise ValueError(f"spec.sidecar.rdma.resourceClaims[{i}]={claim!r}: give a name and exactly one of "
                             f"resourceClaimName or resourceClaimTemplateName (a DRA claim for the RDMA NIC)")
        claims.append(copy.deepcopy(dict(claim)))
    ipc_lock = rdma.get("ipcLock", False)
    if not isinstance(ipc_lock, bool):
        raise ValueError(f"spec.sidecar.rdma.ipcLock={ipc_lock!r}: use true or false")
    return {"resources": devices, "claims": tuple(claims), "ipc_lock": ipc_lock}


def _prefill_tokens_per_second(value: Any) -> float:
    """spec.sidecar.prefillTokensPerSecond: a finite number >= 0 (prompt tokens per second)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"spec.sidecar.prefillTokensPerSecond={value!r}: use a number >= 0, the engine's prefill "
                         f"rate in prompt tokens per second (e.g. 12500; 0 always fetches from peers)")
    return float(value)


def _hash_seed(value: Any) -> str:
    """spec.hashSeed as PYTHONHASHSEED accepts it: a decimal in [0, 4294967295]."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if not (text.isascii() and text.isdigit() and int(text) <= MAX_HASH_SEED):
        raise ValueError(f"spec.hashSeed={value!r}: use a decimal integer in [0, {MAX_HASH_SEED}] "
                         f"as a string, e.g. \"0\" (it becomes PYTHONHASHSEED)")
    return text


def _tls_secret(tls: Any, transport: str) -> str | None:
    """spec.sidecar.tls.secretName, refused with the ucx and nixl transports (which it cannot encrypt)."""
    if tls is None:
        return None
    name = tls.get("secretName") if isinstance(tls, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"spec.sidecar.tls={tls!r} names no Secret: set spec.sidecar.tls.secretName to a Secret "
                         f"with tls.crt, tls.key and ca.crt (a cert-manager Certificate's Secret), or remove "
                         f"spec.sidecar.tls")
    if transport == "nixl":
        raise ValueError(f"spec.sidecar.tls.secretName={name!r} is set but spec.sidecar.dataPlane.transport "
                         f"is {transport!r}: TLS applies to the tcp transport only; the nixl transport sends its "
                         f"requests over tcp but moves chunks with NIXL reads over UCX, which are not "
                         f"encrypted (the sidecar refuses TLS with nixl); set spec.sidecar.dataPlane.transport: "
                         f"tcp, or remove spec.sidecar.tls and keep nixl traffic inside the pool with the "
                         f"NetworkPolicy")
    if transport != "tcp":
        raise ValueError(f"spec.sidecar.tls.secretName={name!r} is set but spec.sidecar.dataPlane.transport "
                         f"is {transport!r}: TLS applies to the tcp transport only and UCX traffic is not "
                         f"encrypted; set spec.sidecar.dataPlane.transport: tcp, or remove spec.sidecar.tls and keep "
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
