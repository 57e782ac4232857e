"""What a pod shares with its node: /dev/shm size, host ports, host namespaces, RDMA claims.

Pure (no kopf, no I/O); ``pod_patch`` applies the results. Each check raises
``ValueError`` with one sentence naming the field, the value and what to
change.

- /dev/shm holds the sidecar's store (``capacityBytes``, filled at start) and
  vLLM's primary CPU tier (``cpu_bytes_to_use`` per engine, a
  ``/dev/shm/vllm_offload_<engine>.mmap`` region), plus head room: the
  emptyDir's ``sizeLimit`` must hold all of it or the kubelet evicts the pod.
  One store, not two: a restarted sidecar makes its store once vLLM's tier
  has let go of the dead one's (``kv_offload_sidecar.store.shm_file``).
- With ``hostNetwork: true`` the sidecar's ports are the node's ports: they
  are declared as ``hostPort`` so the scheduler never puts two pods whose
  ports collide on one node (two pods of one pool, or two pools sharing a
  port range), and a port of the pod's own containers among them is refused.
- UCX's shared memory needs both the host's PID namespace (CMA) and its IPC
  namespace; with only one of them shared UCX picks shared memory for small
  messages and TCP for large ones and the connection never completes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..pools.pool_spec import SHM_HEADROOM_BYTES, SidecarSpec
from ..quantity import format_bytes, parse_bytes
from ..translation.vllm_args import parse_vllm_args

# UCX_TLS names that move data through shared memory between processes.
_SHARED_MEMORY_TLS = frozenset({"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem"})


def primary_tier_bytes(vllm_argv: Sequence[str]) -> int:
    """vLLM's primary CPU tier of one engine in /dev/shm: ``cpu_bytes_to_use`` of its
    ``--kv-transfer-config`` (or ``--kv-offloading-size`` GiB); 0 when it names none."""
    args = parse_vllm_args(list(vllm_argv))
    extra = (args.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    value = extra.get("cpu_bytes_to_use")
    if value is None and args.kv_offloading_size is not None:
        return int(args.kv_offloading_size * (1 << 30))
    try:
        return max(0, int(value)) if value is not None and not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        return 0


def shm_bytes_needed(sidecar: SidecarSpec, primary_bytes: int, engines: int) -> int:
    """What the pod's /dev/shm must hold: the store, each engine's primary tier, head room."""
    return sidecar.capacity_bytes + primary_bytes * max(1, engines) + SHM_HEADROOM_BYTES


def shm_size_limit(sidecar: SidecarSpec, primary_bytes: int, engines: int) -> int:
    """The /dev/shm sizeLimit of the pod: ``spec.shmSizeLimit``, else what it must hold.

    ValueError when ``spec.shmSizeLimit`` is set below the store plus vLLM's primary tier."""
    floor = sidecar.capacity_bytes + primary_bytes * max(1, engines)
    if sidecar.shm_size_limit is None:
        return shm_bytes_needed(sidecar, primary_bytes, engines)
    if sidecar.shm_size_limit < floor:
        raise ValueError(
            f"spec.shmSizeLimit ({format_bytes(sidecar.shm_size_limit)}) cannot hold the sidecar's store "
            f"(spec.sidecar.capacityBytes {format_bytes(sidecar.capacity_bytes)}) and vLLM's primary tier "
            f"({max(1, engines)} x cpu_bytes_to_use {format_bytes(primary_bytes)}) in /dev/shm: raise "
            f"spec.shmSizeLimit to at least {format_bytes(floor + SHM_HEADROOM_BYTES)} or remove it")
    return sidecar.shm_size_limit


def own_shm_resize(pod: Mapping[str, Any], volume: str, limit: int) -> tuple[int, str] | None:
    """(index, new sizeLimit) when the pod's own /dev/shm emptyDir ``volume`` has a
    sizeLimit below ``limit``; None when it is big enough, unlimited or not an emptyDir."""
    for i, vol in enumerate((pod.get("spec") or {}).get("volumes") or []):
        if vol.get("name") != volume:
            continue
        empty = vol.get("emptyDir")
        if not isinstance(empty, Mapping) or empty.get("sizeLimit") is None:
            return None
        have = parse_bytes(empty["sizeLimit"], f"volume {volume!r} emptyDir.sizeLimit")
        return (i, format_bytes(limit)) if have < limit else None
    return None


def host_ports(pod: Mapping[str, Any], ports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The sidecar's container ports, with ``hostPort`` set when the pod uses the host network.

    ValueError when a port of the pod's own containers is one of them (the
    sidecar would fail to bind it on the node)."""
    spec = pod.get("spec") or {}
    result = [dict(p) for p in ports]
    if not spec.get("hostNetwork"):
        return result
    ours = {int(p["containerPort"]): str(p["name"]) for p in result}
    for kind in ("containers", "initContainers"):
        for c in spec.get(kind) or []:
            for p in c.get("ports") or []:
                for field in ("containerPort", "hostPort"):
                    port = p.get(field)
                    if isinstance(port, int) and port in ours:
                        raise ValueError(
                            f"the pod uses hostNetwork and its container {c.get('name')!r} declares "
                            f"{field} {port}, which the sidecar needs for {ours[port]}: on the host network "
                            f"both would bind the node's port {port}; move the pool's ports with "
                            f"spec.sidecar.basePort / spec.sidecar.dataPort, or move the container's port")
    for p in result:
        p["hostPort"] = p["containerPort"]
    return result


def host_namespace_problem(pod: Mapping[str, Any], ucx_tls: str | None) -> str | None:
    """A sentence when UCX would use shared memory but the pod shares only one of the
    host's PID and IPC namespaces; None otherwise (``ucx_tls`` None: tcp transport)."""
    if ucx_tls is None:
        return None
    tls = {t.strip().split(":")[0] for t in ucx_tls.split(",")}
    if not tls & _SHARED_MEMORY_TLS:
        return None
    spec = pod.get("spec") or {}
    ipc, pid = bool(spec.get("hostIPC")), bool(spec.get("hostPID"))
    if ipc == pid:
        return None
    has, lacks = ("hostIPC", "hostPID") if ipc else ("hostPID", "hostIPC")
    return (f"the pod sets {has} but not {lacks}, and UCX_TLS={ucx_tls} lets UCX use shared memory, which "
            f"then completes no connection to a same-node peer (small messages over shared memory, large "
            f"ones over TCP); set both hostIPC and hostPID, neither, or spec.sidecar.ucxTransports: tcp")


def pod_resource_claims(pod: Mapping[str, Any], sidecar: SidecarSpec) -> list[dict[str, Any]]:
    """The PodResourceClaims of spec.sidecar.rdma.resourceClaims the pod does not have yet.

    A claim of the same name already in the pod must be the same claim (else ValueError)."""
    have = {c.get("name"): c for c in (pod.get("spec") or {}).get("resourceClaims") or []}
    missing = []
    for claim in sidecar.resource_claims:
        entry = {k: v for k, v in claim.items() if k != "request"}
        if entry["name"] in have:
            if have[entry["name"]] != entry:
                raise ValueError(f"the pod's resourceClaims already has {entry['name']!r} as "
                                 f"{have[entry['name']]!r}, not {entry!r} (spec.sidecar.rdma.resourceClaims): "
                                 f"rename one of them")
            continue
        missing.append(entry)
    return missing


def container_claims(sidecar: SidecarSpec) -> list[dict[str, str]]:
    """The sidecar container's ``resources.claims`` (name, and request when given)."""
    return [{k: str(v) for k, v in claim.items() if k in ("name", "request")}
            for claim in sidecar.resource_claims]
