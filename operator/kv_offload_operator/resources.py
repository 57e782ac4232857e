"""Pure builders for every Kubernetes object the operator writes or injects.

No kopf, no I/O: each function takes plain dicts (a ``KVOffloadPool`` body, a
pod manifest) and returns plain dicts or RFC 6902 JSON-patch operations, so
all of it is testable without a cluster. ``handlers.py`` calls these and only
moves the results to and from the API server.
"""

from __future__ import annotations

import base64
import copy
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar.offloading_config import OffloadingConfig, identity_diff
from kv_offload_sidecar.vllm_args import parse_vllm_args

from .translate import translate

GROUP = "kv-offload.io"
VERSION = "v1alpha1"
PLURAL = "kvoffloadpools"
KIND = "KVOffloadPool"
# Label that puts a pod into a pool; its value is the pool name.
POOL_LABEL = "kv-offload.io/pool"
# Set on injected pods; its value is the pool fingerprint at injection time.
INJECTED_ANNOTATION = "kv-offload.io/injected"
# Optional pod annotation naming the vLLM container when it cannot be guessed.
VLLM_CONTAINER_ANNOTATION = "kv-offload.io/vllm-container"
CONFIG_KEY = "offloading_config.json"
POOL_KEY_KEY = "key"
CONFIG_DIR = "/etc/kv-offload"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
POOL_KEY_PATH = f"{CONFIG_DIR}/pool-key/{POOL_KEY_KEY}"
TIER_DIR = "/kv-offload-lib"
SHM_DIR = "/dev/shm"
SIDECAR_NAME = "kv-offload-sidecar"
TIER_INIT_NAME = "kv-offload-install-tier"
CONFIG_VOLUME = "kv-offload-config"
SHM_VOLUME = "kv-offload-shm"
TIER_VOLUME = "kv-offload-lib"
DEFAULT_BASE_PORT = 5710
DEFAULT_DATA_PORT = 5810
DEFAULT_CAPACITY_BYTES = 4 << 30
# Head room of the default /dev/shm limit above the chunk store (vLLM, NCCL).
SHM_HEADROOM_BYTES = 1 << 30
DEFAULT_TRANSPORT = "ucx"
TRANSPORTS = ("ucx", "tcp")
# Name of the sidecar's first control port on every pod, whatever its DP start
# rank: the PodMonitor scrapes /metrics there. Other control ports: kvo-ctrl-<i>.
METRICS_PORT_NAME = "kvo-metrics"
# Pool-wide PYTHONHASHSEED (spec.hashSeed): vLLM seeds its prefix hash chain
# (NONE_HASH) with it, randomly per process when it is unset.
HASH_SEED_ENV = "PYTHONHASHSEED"
DEFAULT_HASH_SEED = "0"
# Largest PYTHONHASHSEED Python accepts (it refuses to start above it).
MAX_HASH_SEED = 4294967295
# UCX settings of an injected ucx sidecar unless spec.sidecar.env overrides
# them: TCP reaches peers on other nodes, sm/self serve peers on the same host;
# 1 MiB TCP segments instead of UCX's 8 KiB ones.
UCX_SIDECAR_ENV: Mapping[str, str] = {
    "UCX_TLS": "tcp,sm,self", "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
# Variables the operator owns on the sidecar; spec.sidecar.env may not set them.
_OPERATOR_SIDECAR_ENV = {"VLLM_P2P_SIDE_CHANNEL_HOST": "spec.sidecar.basePort",
                         "VLLM_P2P_SIDE_CHANNEL_PORT": "spec.sidecar.basePort",
                         HASH_SEED_ENV: "spec.hashSeed"}
DEFAULT_SIDECAR_RESOURCES: Mapping[str, Any] = {"requests": {"cpu": "250m", "memory": "256Mi"}}
POOL_KEY_BYTES = 32
# Both injected containers run as the image's non-root user, PSA "restricted"-compatible.
CONTAINER_SECURITY: Mapping[str, Any] = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
_SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash", "/usr/bin/env")

# Every API verb the operator uses, by (apiGroup, resource). The chart's RBAC
# grants exactly this; tests check the operator's requests stay inside it.
OPERATOR_RBAC: Mapping[tuple[str, str], tuple[str, ...]] = {
    (GROUP, PLURAL): ("get", "list", "watch", "patch"),
    (GROUP, f"{PLURAL}/status"): ("patch",),
    ("", "configmaps"): ("get", "create", "patch"),
    ("", "secrets"): ("get", "create"),
    ("", "services"): ("get", "create", "patch"),
    ("", "pods"): ("list", "watch"),
    ("", "events"): ("create",),
}


def configmap_name(pool_name: str) -> str:
    """ConfigMap holding the pool's ``offloading_config.json``."""
    return f"{pool_name}-offloading-config"


def secret_name(pool_name: str) -> str:
    """Secret holding the pool key (HMAC proof between peers)."""
    return f"{pool_name}-pool-key"


def service_name(pool_name: str) -> str:
    """Headless Service whose DNS name lists the pool's pods."""
    return f"{pool_name}-peers"


def peers_dns(pool_name: str, namespace: str) -> str:
    """Fully qualified DNS name of the pool's headless Service."""
    return f"{service_name(pool_name)}.{namespace}.svc.cluster.local"


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
    # Extra sidecar EnvVars (spec.sidecar.env); they override UCX_SIDECAR_ENV.
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


def owner_reference(pool: Mapping[str, Any]) -> dict[str, Any]:
    """The pool as controlling owner: its children are deleted with it."""
    meta = pool["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def _child_meta(pool: Mapping[str, Any], name: str) -> dict[str, Any]:
    meta = pool["metadata"]
    return {"name": name, "namespace": meta["namespace"],
            "labels": {POOL_LABEL: meta["name"], "app.kubernetes.io/managed-by": "kv-offload"},
            "ownerReferences": [owner_reference(pool)]}


def configmap_for(pool: Mapping[str, Any], config: OffloadingConfig) -> dict[str, Any]:
    """ConfigMap ``<pool>-offloading-config`` with key ``offloading_config.json``."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _child_meta(pool, configmap_name(pool["metadata"]["name"])),
            "data": {CONFIG_KEY: config.to_json()}}


def pool_key_secret(pool: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """Secret ``<pool>-pool-key`` holding ``key`` (random bytes chosen by the caller)."""
    if len(key) < 16:
        raise ValueError("pool key must be at least 16 bytes")
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _child_meta(pool, secret_name(pool["metadata"]["name"])),
            "data": {POOL_KEY_KEY: base64.b64encode(key).decode("ascii")}}


def pool_ports(config: OffloadingConfig, sidecar: SidecarSpec) -> dict[str, int]:
    """Port name -> number of every pool sidecar: one control port per DP rank + data.

    These are the peer Service's port names; each pod names its own first
    control port ``kvo-metrics`` instead (see ``sidecar_ports``).
    """
    ports = {f"kvo-ctrl-{i}": sidecar.base_port + i
             for i in range(max(1, config.parallel.data_parallel_size))}
    ports["kvo-data"] = sidecar.data_port
    return ports


def peers_service(pool: Mapping[str, Any], ports: Mapping[str, int]) -> dict[str, Any]:
    """Headless Service ``<pool>-peers`` selecting the pool's pods on ``ports``.

    Not-ready addresses are published: peers find each other while vLLM is
    still loading, and the handshake (not DNS) decides who may share.
    """
    name = pool["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _child_meta(pool, service_name(name)),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {POOL_LABEL: name},
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"}
                               for n, p in ports.items()]}}


# ---- the pod side -----------------------------------------------------------

def container_argv(container: Mapping[str, Any]) -> list[str]:
    """The command line a container runs; ``sh -c "..."`` scripts are split."""
    argv = [str(a) for a in (container.get("command") or [])] + \
           [str(a) for a in (container.get("args") or [])]
    if argv and argv[0] in _SHELLS and "-c" in argv:
        i = argv.index("-c")
        if i + 1 < len(argv):
            return shlex.split(argv[i + 1])
    return argv


def _runs_vllm(argv: Sequence[str]) -> bool:
    return any(a == "vllm" or a.endswith("/vllm") or a.startswith("vllm.") for a in argv)


def find_vllm_container(pod: Mapping[str, Any]) -> int:
    """Index of the vLLM container in ``spec.containers``; ValueError says how to name it."""
    containers = (pod.get("spec") or {}).get("containers") or []
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(VLLM_CONTAINER_ANNOTATION)
    if wanted:
        for i, c in enumerate(containers):
            if c.get("name") == wanted:
                return i
        raise ValueError(f"annotation {VLLM_CONTAINER_ANNOTATION}={wanted!r} names no container of the pod")
    candidates = [i for i, c in enumerate(containers) if _runs_vllm(container_argv(c))]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates and len(containers) == 1:
        return 0
    raise ValueError(f"cannot tell which container runs vLLM ({len(candidates)} candidates); "
                     f"set annotation {VLLM_CONTAINER_ANNOTATION}: <container name>")


def pod_dp_indices(container: Mapping[str, Any]) -> tuple[int, ...]:
    """Global data-parallel indices the vLLM container serves (from its args)."""
    indices = tuple(parse_vllm_args(container_argv(container)).pod_dp_indices())
    return indices or (0,)


def sidecar_container(*, pool_name: str, namespace: str, sidecar: SidecarSpec,
                      dp_indices: Sequence[int], shm_volume: str) -> dict[str, Any]:
    """The native sidecar: an init container with ``restartPolicy: Always``."""
    first = sidecar.base_port + dp_indices[0]
    args = ["sidecar", "--config", CONFIG_PATH, "--pool-key-file", POOL_KEY_PATH,
            "--peers-dns", peers_dns(pool_name, namespace),
            "--base-port", str(sidecar.base_port), "--data-port", str(sidecar.data_port),
            "--capacity-bytes", str(sidecar.capacity_bytes), "--transport", sidecar.transport,
            "--dp-indices", ",".join(str(i) for i in dp_indices), "--shm-dir", SHM_DIR]
    ports = sidecar_ports(sidecar, dp_indices)

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": first}, "periodSeconds": period,
                "timeoutSeconds": 2, "failureThreshold": failures}

    return {
        "name": SIDECAR_NAME,
        "image": sidecar.image,
        "command": ["kv-offload"],
        "args": args,
        "restartPolicy": "Always",
        "env": sidecar_env(sidecar),
        "ports": ports,
        # vLLM starts only once the sidecar answers (native sidecar semantics).
        "startupProbe": probe("/healthz", 1, 60),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 3),
        "resources": copy.deepcopy(dict(sidecar.resources)),
        "securityContext": copy.deepcopy(dict(CONTAINER_SECURITY)),
        "volumeMounts": [{"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": shm_volume, "mountPath": SHM_DIR}],
    }


def sidecar_ports(sidecar: SidecarSpec, dp_indices: Sequence[int]) -> list[dict[str, Any]]:
    """Container ports: the first control port is ``kvo-metrics`` on every pod
    (one stable name to scrape, whatever the pod's DP start rank), the other
    control ports ``kvo-ctrl-<global DP index>``, then ``kvo-data``."""
    ports = [{"name": METRICS_PORT_NAME if n == 0 else f"kvo-ctrl-{i}",
              "containerPort": sidecar.base_port + i, "protocol": "TCP"}
             for n, i in enumerate(dp_indices)]
    ports.append({"name": "kvo-data", "containerPort": sidecar.data_port, "protocol": "TCP"})
    return ports


def sidecar_env(sidecar: SidecarSpec) -> list[dict[str, Any]]:
    """The sidecar's env: side channel, the pool's PYTHONHASHSEED (the hash seed
    it states in the handshake), UCX defaults (ucx transport), then
    ``spec.sidecar.env``, which replaces a UCX default of the same name."""
    env = side_channel_env(sidecar.base_port) + [{"name": HASH_SEED_ENV, "value": sidecar.hash_seed}]
    user = {str(e["name"]) for e in sidecar.env}
    if sidecar.transport == "ucx":
        env += [{"name": k, "value": v} for k, v in UCX_SIDECAR_ENV.items() if k not in user]
    return env + [copy.deepcopy(dict(e)) for e in sidecar.env]


def tier_init_container(sidecar: SidecarSpec) -> dict[str, Any]:
    """Copies the vLLM-side tier into the shared volume (same image as the sidecar)."""
    return {"name": TIER_INIT_NAME, "image": sidecar.image,
            "command": ["kv-offload"], "args": ["install-tier", TIER_DIR],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
            "securityContext": copy.deepcopy(dict(CONTAINER_SECURITY)),
            "volumeMounts": [{"name": TIER_VOLUME, "mountPath": TIER_DIR}]}


def side_channel_env(base_port: int) -> list[dict[str, Any]]:
    """vLLM's side-channel variables: host = pod IP (downward API), port = base."""
    return [{"name": "VLLM_P2P_SIDE_CHANNEL_HOST",
             "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
            {"name": "VLLM_P2P_SIDE_CHANNEL_PORT", "value": str(base_port)}]


def pod_volumes(pool_name: str, sidecar: SidecarSpec, *, with_shm: bool) -> list[dict[str, Any]]:
    """Config (ConfigMap + Secret projected together), shm and tier volumes."""
    vols: list[dict[str, Any]] = [
        {"name": CONFIG_VOLUME, "projected": {"sources": [
            {"configMap": {"name": configmap_name(pool_name),
                           "items": [{"key": CONFIG_KEY, "path": CONFIG_KEY}]}},
            {"secret": {"name": secret_name(pool_name),
                        "items": [{"key": POOL_KEY_KEY, "path": f"pool-key/{POOL_KEY_KEY}"}]}}]}},
        {"name": TIER_VOLUME, "emptyDir": {}},
    ]
    if with_shm:
        vols.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": str(sidecar.shm_size_limit)}})
    return vols


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _existing_shm_volume(container: Mapping[str, Any]) -> str | None:
    for m in container.get("volumeMounts") or []:
        if m.get("mountPath", "").rstrip("/") == SHM_DIR:
            return str(m["name"])
    return None


def _check_vllm_hash_seed(container: Mapping[str, Any], seed: str) -> None:
    """ValueError unless every PYTHONHASHSEED the vLLM container sets equals ``seed``.

    Looks at ``env`` and at ``NAME=value`` words leading its command line (a
    shell script's ``PYTHONHASHSEED=5 vllm serve ...`` wins over ``env``).
    """
    for e in container.get("env") or []:
        if e.get("name") != HASH_SEED_ENV:
            continue
        if "valueFrom" in e:
            raise ValueError(f"the vLLM container sets {HASH_SEED_ENV} with valueFrom, so it cannot be checked "
                             f"against the pool's spec.hashSeed {seed!r}; remove {HASH_SEED_ENV} from the "
                             f"container (the webhook sets it) or set it as a plain value equal to spec.hashSeed")
        value = str(e.get("value", ""))
        if value != seed:
            raise ValueError(f"the vLLM container sets {HASH_SEED_ENV}={value!r} but the pool's spec.hashSeed is "
                             f"{seed!r}, and pods with different seeds never share chunks; remove {HASH_SEED_ENV} "
                             f"from the container (the webhook sets it), or set spec.hashSeed: {value!r} on the pool")
    value = parse_vllm_args(container_argv(container)).env.get(HASH_SEED_ENV)
    if value is not None and value != seed:
        raise ValueError(f"the vLLM container's command line sets {HASH_SEED_ENV}={value!r} but the pool's "
                         f"spec.hashSeed is {seed!r}, and pods with different seeds never share chunks; remove "
                         f"{HASH_SEED_ENV} from the command line (the webhook sets it), or set "
                         f"spec.hashSeed: {value!r} on the pool")


def _vllm_env(container: Mapping[str, Any], sidecar: SidecarSpec) -> list[dict[str, Any]]:
    _check_vllm_hash_seed(container, sidecar.hash_seed)
    ours = side_channel_env(sidecar.base_port) + [{"name": HASH_SEED_ENV, "value": sidecar.hash_seed}]
    names = {e["name"] for e in ours} | {"PYTHONPATH"}
    env = [copy.deepcopy(dict(e)) for e in container.get("env") or [] if e.get("name") not in names]
    old_path = next((e for e in container.get("env") or [] if e.get("name") == "PYTHONPATH"), None)
    if old_path is not None and "valueFrom" in old_path:
        raise ValueError("the vLLM container sets PYTHONPATH with valueFrom; "
                         "set it as a plain value so the tier directory can be prepended")
    path = TIER_DIR if not (old_path and old_path.get("value")) else f"{TIER_DIR}:{old_path['value']}"
    return env + ours + [{"name": "PYTHONPATH", "value": path}]


def pod_identity_problem(pod: Mapping[str, Any], pool_config: OffloadingConfig,
                         model_config: Mapping[str, Any]) -> str | None:
    """None when the pod's vLLM container translates to the pool's fingerprint.

    Otherwise a clause naming both fingerprints and every identity field that
    differs: such a pod would never share with its pool, so it is refused at
    admission rather than failing closed at every handshake. Raises ValueError
    (the translator's message) when the pod's arguments do not translate.
    """
    container = ((pod.get("spec") or {}).get("containers") or [])[find_vllm_container(pod)]
    env = {str(e["name"]): str(e["value"]) for e in container.get("env") or [] if "value" in e}
    pod_config = translate(container_argv(container), model_config, env=env)
    if pod_config.fingerprint == pool_config.fingerprint:
        return None
    diff = "; ".join(identity_diff(pool_config, pod_config)) or "no field diff"
    return (f"its vLLM arguments give fingerprint {pod_config.fingerprint} but the pool's is "
            f"{pool_config.fingerprint} (pool != pod: {diff}); make the container's vllm serve "
            f"arguments match the pool's spec.vllmArgs")


def is_injected(pod: Mapping[str, Any]) -> bool:
    """True when the pod already carries the sidecar (annotation or container)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    inits = (pod.get("spec") or {}).get("initContainers") or []
    return INJECTED_ANNOTATION in annotations or any(c.get("name") == SIDECAR_NAME for c in inits)


def pod_patch(pod: Mapping[str, Any], pool: Mapping[str, Any], *, fingerprint: str,
              sidecar: SidecarSpec) -> list[dict[str, Any]]:
    """RFC 6902 operations that wire ``pod`` into ``pool``; [] when already injected.

    Adds the tier-copy init container and the native sidecar, the config /
    shm / tier volumes, the side-channel env, the pool's ``PYTHONHASHSEED``,
    ``PYTHONPATH`` and mounts on the vLLM container, and the
    ``kv-offload.io/injected`` annotation. A vLLM container that sets another
    ``PYTHONHASHSEED`` than the pool's ``spec.hashSeed`` is refused. A pod that
    already mounts something at /dev/shm keeps that volume and shares it.
    Raises ValueError (one sentence) when the pod cannot be wired.
    """
    if is_injected(pod):
        return []
    pool_name = pool["metadata"]["name"]
    namespace = (pod.get("metadata") or {}).get("namespace") or pool["metadata"]["namespace"]
    spec = pod.get("spec") or {}
    index = find_vllm_container(pod)
    vllm = spec["containers"][index]
    try:
        dp_indices = pod_dp_indices(vllm)
    except ValueError as exc:
        raise ValueError(f"the vLLM arguments of container {vllm.get('name')!r} do not parse: {exc}") from None
    existing_shm = _existing_shm_volume(vllm)
    shm_volume = existing_shm or SHM_VOLUME
    ops: list[dict[str, Any]] = []
    meta = pod.get("metadata") or {}
    if "annotations" not in meta:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    ops.append({"op": "add", "path": f"/metadata/annotations/{_escape(INJECTED_ANNOTATION)}",
                "value": fingerprint})

    def append_all(path: str, present: bool, items: list[dict[str, Any]]) -> None:
        if not present:
            ops.append({"op": "add", "path": path, "value": items})
        else:
            ops.extend({"op": "add", "path": f"{path}/-", "value": item} for item in items)

    inits = [tier_init_container(sidecar),
             sidecar_container(pool_name=pool_name, namespace=namespace, sidecar=sidecar,
                               dp_indices=dp_indices, shm_volume=shm_volume)]
    append_all("/spec/initContainers", "initContainers" in spec, inits)
    append_all("/spec/volumes", "volumes" in spec,
               pod_volumes(pool_name, sidecar, with_shm=existing_shm is None))
    base = f"/spec/containers/{index}"
    ops.append({"op": "add", "path": f"{base}/env", "value": _vllm_env(vllm, sidecar)})
    mounts = [{"name": TIER_VOLUME, "mountPath": TIER_DIR, "readOnly": True}]
    if existing_shm is None:
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_DIR})
    append_all(f"{base}/volumeMounts", "volumeMounts" in vllm, mounts)
    return ops


def apply_patch(doc: dict[str, Any], ops: Sequence[Mapping[str, Any]]) -> None:
    """Apply RFC 6902 ``add``/``replace``/``remove`` ops to ``doc`` in place.

    Only the operations ``pod_patch`` emits; the webhook hands the result to
    kopf's ``patch``, which re-derives the JSON patch it answers with.
    """
    for op in ops:
        *parents, last = [t.replace("~1", "/").replace("~0", "~")
                          for t in str(op["path"]).split("/")[1:]]
        target: Any = doc
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        kind = op["op"]
        if isinstance(target, list):
            if kind == "add":
                target.insert(len(target) if last == "-" else int(last), copy.deepcopy(op["value"]))
            elif kind == "replace":
                target[int(last)] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del target[int(last)]
            else:
                raise ValueError(f"unsupported JSON-patch op {kind!r}")
        elif kind in ("add", "replace"):
            target[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del target[last]
        else:
            raise ValueError(f"unsupported JSON-patch op {kind!r}")


def pool_conditions(old: Sequence[Mapping[str, Any]] | None, *, invalid_message: str | None,
                    generation: int | None, now: str,
                    waiting_message: str | None = None) -> list[dict[str, Any]]:
    """The pool's ``Ready`` and ``Invalid`` conditions after one reconciliation.

    ``invalid_message``: the spec does not translate (Invalid=True).
    ``waiting_message``: something outside the spec is missing and is retried
    (Ready=False, Invalid=Unknown). Neither: the children are written.
    ``lastTransitionTime`` only moves when a condition's status flips.
    """
    previous = {c.get("type"): c for c in old or []}
    if invalid_message is not None:
        wanted = {"Ready": ("False", "InvalidSpec", "The spec does not translate; the last good config is kept."),
                  "Invalid": ("True", "TranslationFailed", invalid_message)}
    elif waiting_message is not None:
        wanted = {"Ready": ("False", "Waiting", waiting_message),
                  "Invalid": ("Unknown", "Waiting", "Not translated yet.")}
    else:
        wanted = {"Ready": ("True", "ConfigWritten", "The offloading config, pool key and peer Service are in place."),
                  "Invalid": ("False", "Translated", "The spec translates into an OffloadingConfig.")}
    result: list[dict[str, Any]] = []
    for type_, (status, reason, message) in wanted.items():
        before = previous.get(type_) or {}
        since = before.get("lastTransitionTime") if before.get("status") == status else None
        cond: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message,
                                "lastTransitionTime": since or now}
        if generation is not None:
            cond["observedGeneration"] = generation
        result.append(cond)
    return result


def invalid_message(pool: Mapping[str, Any]) -> str | None:
    """The message of a pool's ``Invalid=True`` condition, else None."""
    for cond in (pool.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Invalid" and cond.get("status") == "True":
            return str(cond.get("message") or "no message")
    return None
