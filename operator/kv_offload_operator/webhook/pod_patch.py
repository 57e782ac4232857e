"""The webhook's mutation: what a labelled pod needs to join its pool, as RFC 6902 operations.

Pure (no kopf, no I/O). ``pod_patch`` adds the tier-copy init container, the
native sidecar (its DP ranks read from the pod's own vLLM arguments, passed
as ``--dp-indices``), the config / pool Secret / TLS / shm / tier volumes and
the vLLM container's env and mounts (and, opted in, its ``--kv-transfer-config``:
``kv_transfer``; what the pod shares with its node: ``pod_host``); ``pod_identity_problem`` refuses a pod
whose own vLLM arguments translate to another fingerprint than its pool's, or declare
another model identity (``translation.declared_identity``).
The pool Secret is mounted whole, without ``subPath``, so a rotated key
reaches the running sidecar (the kubelet updates the files in place) and
``previous-key`` appears and goes with the Secret entry.

vLLM never depends on kv-offload to start (issue 49): every reference to
the pool's ConfigMap and Secrets (the config and Secret volumes, the TLS
Secret, the ``PYTHONHASHSEED`` secretKeyRef) is ``optional``, so a pool that
was deleted (its objects garbage-collected) leaves its pods able to restart
their containers; and the sidecar has no startupProbe, so the kubelet starts
vLLM as soon as the sidecar's process runs, whether or not it ever answers
(vLLM's tier runs detached until it does: ``engine.sidecar_link``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from kv_offload_sidecar.cpu_budget import CPU_REQUEST_ENV
from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig, identity_diff

from . import pod_defaults, pod_host
from ..pools import kv_transfer
from ..pools.pool_objects import (
    ADMIN_TOKEN_KEY,
    CONFIG_KEY,
    HASH_SEED_KEY,
    POOL_KEY_KEY,
    PREVIOUS_KEY_KEY,
    configmap_name,
    peers_dns,
    secret_name,
)
from ..pools.pool_pod import (  # the names injection marks a pod with, and its vLLM container
    INJECTED_ANNOTATION,
    METRICS_PORT_NAME,
    SIDECAR_NAME,
    container_accelerators,
    container_argv,
    find_vllm_container,
)
from ..pools.pool_spec import DEFAULT_LANES, HASH_SEED_ENV, SidecarSpec
from ..quantity import format_bytes
from ..translation.declared_identity import declared_diff, declared_identity
from ..translation.translate import translate
from ..translation.vllm_releases import release_of_image
from ..translation.vllm_args import parse_vllm_args

# Where the sidecar finds the pool's config.
CONFIG_DIR = "/etc/kv-offload"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
# Where the sidecar finds the whole pool Secret (its own volume, files updated in place).
POOL_SECRET_DIR = "/etc/kv-offload-pool-key"
POOL_KEY_PATH = f"{POOL_SECRET_DIR}/{POOL_KEY_KEY}"
PREVIOUS_KEY_PATH = f"{POOL_SECRET_DIR}/{PREVIOUS_KEY_KEY}"
ADMIN_TOKEN_PATH = f"{POOL_SECRET_DIR}/{ADMIN_TOKEN_KEY}"
# Where the sidecar finds spec.sidecar.tls.secretName (cert-manager's Secret layout).
TLS_DIR = "/etc/kv-offload-tls"
# Shared volume holding the vLLM-side tier, first on vLLM's PYTHONPATH.
TIER_DIR = "/kv-offload-lib"
SHM_DIR = "/dev/shm"
TIER_INIT_NAME = "kv-offload-install-tier"
CONFIG_VOLUME = "kv-offload-config"
POOL_SECRET_VOLUME = "kv-offload-pool-key"
TLS_VOLUME = "kv-offload-tls"
SHM_VOLUME = "kv-offload-shm"
TIER_VOLUME = "kv-offload-lib"
# UCX settings of an injected ucx sidecar unless spec.sidecar.env overrides
# them: TCP reaches peers on other nodes, sm/self serve peers on the same host;
# 1 MiB TCP segments instead of UCX's 8 KiB ones. UCX_TLS is this default
# (spec.sidecar.ucxTransports: tcp-sm) or the pool's ucxTransports preset.
UCX_SIDECAR_ENV: Mapping[str, str] = {
    "UCX_TLS": "tcp,sm,self", "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
# Seconds after the sidecar starts before its liveness probe counts: it pre-faults
# its store first, so the allowance grows with it (1 s per GiB on top of a minute).
LIVENESS_GRACE_SECONDS = 60
# Both injected containers run as the image's non-root user, PSA "restricted"-compatible.
CONTAINER_SECURITY: Mapping[str, Any] = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


# ---- reading the pod ------------------------------------------------------------

def pod_dp_indices(container: Mapping[str, Any]) -> tuple[int, ...]:
    """Global data-parallel indices the vLLM container serves (from its args)."""
    indices = tuple(parse_vllm_args(container_argv(container)).pod_dp_indices())
    return indices or (0,)


def is_injected(pod: Mapping[str, Any]) -> bool:
    """True when the pod already carries the sidecar (annotation or container)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    inits = (pod.get("spec") or {}).get("initContainers") or []
    return INJECTED_ANNOTATION in annotations or any(c.get("name") == SIDECAR_NAME for c in inits)


def pod_identity_problem(pod: Mapping[str, Any], pool_config: OffloadingConfig,
                         model_config: Mapping[str, Any], *,
                         connector: kv_transfer.InjectedConnector | None = None,
                         source: str = "spec.vllmArgs",
                         vllm_version: str | None = None,
                         declared: Mapping[str, str] | None = None) -> str | None:
    """None when the pod's vLLM container translates to the pool's fingerprint (and, given
    the pool's ``declared`` model identity, declares the same: ``declared_identity``).

    Otherwise a clause naming both fingerprints and every identity field that
    differs: such a pod would never share with its pool, so it is refused at
    admission rather than failing closed at every handshake. Raises ValueError
    (the translator's message) when the pod's arguments do not translate.
    ``connector``: the pool's ``spec.injectKVTransferConfig``, added to a command
    line without ``--kv-transfer-config`` as the webhook will; ``source``: where the
    pool's command line comes from (``pool_source.VllmSource.where``); ``vllm_version``: the
    pool's vLLM release, used unless the pod's image tag names its own.
    """
    container = ((pod.get("spec") or {}).get("containers") or [])[find_vllm_container(pod)]
    env = {str(e["name"]): str(e["value"]) for e in container.get("env") or [] if "value" in e}
    argv = kv_transfer.effective_argv(container_argv(container), connector,
                                      f"the vLLM container {container.get('name')!r}")
    version = release_of_image(container.get("image")) or vllm_version
    pod_config = translate(argv, model_config, env=env, vllm_version=version,
                           accelerators=container_accelerators(container))
    if pod_config.fingerprint == pool_config.fingerprint:
        if declared is None:
            return None
        pod_declared = declared_identity(argv, model_config)
        declared_lines = declared_diff(declared, pod_declared)
        if not declared_lines:
            return None
        return (f"its vLLM arguments declare another model identity than the pool's (pool != "
                f"pod: {'; '.join(declared_lines)}), so its KV bytes differ under the same "
                f"fingerprint; make the container's vllm serve arguments match the pool's {source}")
    diff = "; ".join(identity_diff(pool_config, pod_config)) or "no field diff"
    return (f"its vLLM arguments give fingerprint {pod_config.fingerprint} but the pool's is "
            f"{pool_config.fingerprint} (pool != pod: {diff}); make the container's vllm serve "
            f"arguments match the pool's {source}")


# ---- what is injected -------------------------------------------------------------

def sidecar_container(*, pool_name: str, namespace: str, sidecar: SidecarSpec,
                      dp_indices: Sequence[int], shm_volume: str,
                      pod: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The native sidecar: an init container with ``restartPolicy: Always``.

    Its DP ranks are this pod's (``--dp-indices``), not the pool ConfigMap's.
    It has no readinessProbe: a native sidecar's readiness counts toward the
    pod's Ready condition, and without a probe the kubelet counts it ready
    for as long as its process runs, so nothing the sidecar reports ever
    takes the vLLM replica out of its Service. A sidecar restart takes the pod
    out of its Service's ready endpoints only while the sidecar container is
    not running (between its exit and its restart, back-off included); vLLM
    keeps running and the tier serves misses meanwhile. It has no startupProbe
    either, so a sidecar that cannot start (or answer) never keeps vLLM from
    starting: the kubelet starts vLLM once the sidecar's process runs. ``pod``: ports become host ports on the
    host network (``pod_host.host_ports``). ``--prefill-tokens-per-second`` and
    ``--peer-copies`` are always given, defaults included, so the pod spec
    states the fetch-or-recompute rate and sharing policy its sidecar runs.
    """
    first = sidecar.control_port(dp_indices[0])
    args = ["sidecar", "--config", CONFIG_PATH, "--pool-key-file", POOL_KEY_PATH,
            "--previous-pool-key-file", PREVIOUS_KEY_PATH, "--admin-token-file", ADMIN_TOKEN_PATH,
            "--peers-dns", peers_dns(pool_name, namespace),
            "--base-port", str(sidecar.base_port), "--data-port", str(sidecar.data_port),
            "--capacity-bytes", str(sidecar.capacity_bytes), "--transport", sidecar.transport,
            "--prefill-tokens-per-second", format_rate(sidecar.prefill_tokens_per_second),
            "--peer-copies", sidecar.peer_copies,
            "--dp-indices", ",".join(str(i) for i in dp_indices), "--shm-dir", SHM_DIR]
    mounts = [{"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": POOL_SECRET_VOLUME, "mountPath": POOL_SECRET_DIR, "readOnly": True}]
    if sidecar.engine_metrics_url:
        args += ["--engine-metrics-url", sidecar.engine_metrics_url]
    if sidecar.lanes != DEFAULT_LANES:  # unset stays off the line: a sidecar of the last release knows no --lanes
        args += ["--lanes", str(sidecar.lanes)]
    if sidecar.tls_secret is not None:
        args += ["--tls-cert-file", f"{TLS_DIR}/tls.crt", "--tls-key-file", f"{TLS_DIR}/tls.key",
                 "--tls-ca-file", f"{TLS_DIR}/ca.crt"]
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    mounts.append({"name": shm_volume, "mountPath": SHM_DIR})

    def probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": first}, "periodSeconds": period,
                "timeoutSeconds": timeout, "failureThreshold": failures}

    resources = copy.deepcopy(dict(sidecar.resources))
    if sidecar.resource_claims:
        resources["claims"] = pod_host.container_claims(sidecar)
    security = copy.deepcopy(dict(CONTAINER_SECURITY))
    if sidecar.ipc_lock:  # Kubernetes gives added capabilities to root processes only
        security.update(runAsNonRoot=False, runAsUser=0)
        security["capabilities"]["add"] = ["IPC_LOCK"]
    ports = sidecar_ports(sidecar, dp_indices)
    return {
        "name": SIDECAR_NAME,
        "image": sidecar.image,
        "command": ["kv-offload"],
        "args": args,
        "restartPolicy": "Always",
        "env": sidecar_env(sidecar, pool_name=pool_name),
        "ports": pod_host.host_ports(pod, ports) if pod is not None else ports,
        # No startupProbe: the kubelet would start vLLM only once the sidecar answers.
        # A minute without an answer before a restart (a restart empties the store),
        # counted once the store is pre-faulted.
        "livenessProbe": {**probe("/healthz", 10, 5, 6), "initialDelaySeconds":
                          LIVENESS_GRACE_SECONDS + -(-sidecar.capacity_bytes // (1 << 30))},
        "resources": resources,
        "securityContext": security,
        "volumeMounts": mounts,
    }


def format_rate(value: float) -> str:
    """A rate as a sidecar flag value: "0", "12500", "2500.5" (exact: the float's shortest repr)."""
    return repr(float(value)).removesuffix(".0")


def sidecar_ports(sidecar: SidecarSpec, dp_indices: Sequence[int]) -> list[dict[str, Any]]:
    """Container ports: the first control port is ``kvo-metrics`` on every pod
    (one stable name to scrape, whatever the pod's DP start rank), the other
    control ports ``kvo-ctrl-<global DP index>``, then ``kvo-data``."""
    ports = [{"name": METRICS_PORT_NAME if n == 0 else f"kvo-ctrl-{i}",
              "containerPort": sidecar.control_port(i), "protocol": "TCP"}
             for n, i in enumerate(dp_indices)]
    ports.append({"name": "kvo-data", "containerPort": sidecar.data_port, "protocol": "TCP"})
    return ports


def sidecar_env(sidecar: SidecarSpec, *, pool_name: str) -> list[dict[str, Any]]:
    """The sidecar's env: side channel, the pool's PYTHONHASHSEED (the hash seed
    it states in the handshake), UCX defaults (ucx transport), its own CPU request
    (``cpu_request_env``), then ``spec.sidecar.env``, which replaces a UCX default of the
    same name."""
    env = side_channel_env(sidecar.base_port) + [hash_seed_env(sidecar, pool_name)]
    user = {str(e["name"]) for e in sidecar.env}
    if sidecar.transport == "ucx":
        ucx = dict(UCX_SIDECAR_ENV, UCX_TLS=sidecar.ucx_tls)
        env += [{"name": k, "value": v} for k, v in ucx.items() if k not in user]
    return env + [cpu_request_env()] + [copy.deepcopy(dict(e)) for e in sidecar.env]


def cpu_request_env() -> dict[str, Any]:
    """The sidecar container's CPU request in whole millicores (downward API): the sidecar's
    CPU budget where no CPU limit is set (``kv_offload_sidecar.cpu_budget``)."""
    return {"name": CPU_REQUEST_ENV, "valueFrom": {"resourceFieldRef": {
        "containerName": SIDECAR_NAME, "resource": "requests.cpu", "divisor": "1m"}}}


def tier_init_container(sidecar: SidecarSpec) -> dict[str, Any]:
    """Copies the vLLM-side tier into the shared volume (same image as the sidecar)."""
    return {"name": TIER_INIT_NAME, "image": sidecar.image,
            "command": ["kv-offload"], "args": ["install-tier", TIER_DIR],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
            "securityContext": copy.deepcopy(dict(CONTAINER_SECURITY)),
            "volumeMounts": [{"name": TIER_VOLUME, "mountPath": TIER_DIR}]}


def hash_seed_env(sidecar: SidecarSpec, pool_name: str) -> dict[str, Any]:
    """PYTHONHASHSEED of the pool's vLLM and sidecar containers: spec.hashSeed as a
    plain value, else the pool's secret seed read from its Secret by the kubelet
    (it never appears in the pod spec or the ConfigMap)."""
    if sidecar.hash_seed is not None:
        return {"name": HASH_SEED_ENV, "value": sidecar.hash_seed}
    return {"name": HASH_SEED_ENV,
            "valueFrom": {"secretKeyRef": {"name": secret_name(pool_name), "key": HASH_SEED_KEY,
                                           "optional": True}}}


def side_channel_env(base_port: int) -> list[dict[str, Any]]:
    """vLLM's side-channel variables: host = pod IP (downward API), port = base."""
    return [{"name": ports.ENV_HOST,
             "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
            {"name": ports.ENV_PORT, "value": str(base_port)}]


def pod_volumes(pool_name: str, sidecar: SidecarSpec, *, with_shm: bool,
                shm_bytes: int | None = None) -> list[dict[str, Any]]:
    """Config, pool Secret, TLS (spec.sidecar.tls), shm (``shm_bytes``, default: the store
    plus head room) and tier volumes.

    Both Secrets are mounted whole (no ``items``): every entry present is a
    file, updated in place when the Secret changes, and an entry that is
    absent (``previous-key`` outside a rotation) is simply no file.
    """
    vols: list[dict[str, Any]] = [
        {"name": CONFIG_VOLUME, "projected": {"sources": [
            {"configMap": {"name": configmap_name(pool_name), "optional": True,
                           "items": [{"key": CONFIG_KEY, "path": CONFIG_KEY}]}}]}},
        {"name": POOL_SECRET_VOLUME, "secret": {"secretName": secret_name(pool_name), "optional": True}},
        {"name": TIER_VOLUME, "emptyDir": {}},
    ]
    if sidecar.tls_secret is not None:
        vols.append({"name": TLS_VOLUME, "secret": {"secretName": sidecar.tls_secret, "optional": True}})
    if with_shm:
        size = shm_bytes if shm_bytes is not None else pod_host.shm_size_limit(sidecar, 0, 1)
        vols.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(size)}})
    return vols


def _existing_shm_volume(container: Mapping[str, Any]) -> str | None:
    for m in container.get("volumeMounts") or []:
        if m.get("mountPath", "").rstrip("/") == SHM_DIR:
            return str(m["name"])
    return None


def _check_vllm_hash_seed(container: Mapping[str, Any], seed: str | None, pool_name: str) -> None:
    """ValueError unless every PYTHONHASHSEED the vLLM container sets equals ``seed``;
    with a secret seed (``seed`` None) the container may set none at all.

    Looks at ``env`` and at ``NAME=value`` words leading its command line (a
    shell script's ``PYTHONHASHSEED=5 vllm serve ...`` wins over ``env``).
    """
    if seed is None:
        _check_no_vllm_hash_seed(container, pool_name)
        return
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


def _check_no_vllm_hash_seed(container: Mapping[str, Any], pool_name: str) -> None:
    """ValueError when the vLLM container sets PYTHONHASHSEED in a pool that uses its secret seed."""
    where = None
    for e in container.get("env") or []:
        if e.get("name") == HASH_SEED_ENV:
            where = f"sets {HASH_SEED_ENV} with valueFrom" if "valueFrom" in e else \
                f"sets {HASH_SEED_ENV}={str(e.get('value', ''))!r}"
    value = parse_vllm_args(container_argv(container)).env.get(HASH_SEED_ENV)
    if value is not None:
        where = f"command line sets {HASH_SEED_ENV}={value!r}"
    if where is not None:
        raise ValueError(f"the vLLM container {where} but the pool has no spec.hashSeed, so the webhook sets "
                         f"{HASH_SEED_ENV} from the pool's secret seed (Secret {secret_name(pool_name)!r}, key "
                         f"{HASH_SEED_KEY!r}); remove {HASH_SEED_ENV} from the container, or set spec.hashSeed "
                         f"on the pool (a fixed seed: anyone who can guess it can compute chunk keys from prompts)")


def _vllm_env(container: Mapping[str, Any], sidecar: SidecarSpec, pool_name: str) -> list[dict[str, Any]]:
    _check_vllm_hash_seed(container, sidecar.hash_seed, pool_name)
    ours = side_channel_env(sidecar.base_port) + [hash_seed_env(sidecar, pool_name)]
    names = {e["name"] for e in ours} | {"PYTHONPATH"}
    env = [copy.deepcopy(dict(e)) for e in container.get("env") or [] if e.get("name") not in names]
    old_path = next((e for e in container.get("env") or [] if e.get("name") == "PYTHONPATH"), None)
    if old_path is not None and "valueFrom" in old_path:
        raise ValueError("the vLLM container sets PYTHONPATH with valueFrom; "
                         "set it as a plain value so the tier directory can be prepended")
    path = TIER_DIR if not (old_path and old_path.get("value")) else f"{TIER_DIR}:{old_path['value']}"
    return env + ours + [{"name": "PYTHONPATH", "value": path}]


# ---- the patch ----------------------------------------------------------------------

def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def pod_patch(pod: Mapping[str, Any], pool: Mapping[str, Any], *, fingerprint: str,
              sidecar: SidecarSpec) -> list[dict[str, Any]]:
    """RFC 6902 operations that wire ``pod`` into ``pool``; [] when already injected.

    Adds the tier-copy init container and the native sidecar, the config /
    pool Secret / TLS / shm / tier volumes, the side-channel env, the pool's
    ``PYTHONHASHSEED`` (spec.hashSeed, else a secretKeyRef to the pool's secret
    seed), ``PYTHONPATH`` and mounts on the vLLM container, and the
    ``kv-offload.io/injected`` annotation. A vLLM container that sets another
    ``PYTHONHASHSEED`` than the pool's ``spec.hashSeed``, or any while the pool
    uses its secret seed, is refused. A pod that already mounts something at
    /dev/shm keeps that volume and shares it (an emptyDir's sizeLimit is raised
    to hold the store and vLLM's primary tier, ``pod_host``). With
    ``spec.injectKVTransferConfig`` a vLLM command line without
    ``--kv-transfer-config`` gets ours. Host network pods get host ports; a pod
    sharing only one of the host's PID and IPC namespaces while UCX may use
    shared memory is refused; RDMA claims (spec.sidecar.rdma) are added.
    Raises ValueError (one sentence) when the pod cannot be wired.
    """
    if is_injected(pod):
        return []
    pool_name = pool["metadata"]["name"]
    namespace = (pod.get("metadata") or {}).get("namespace") or pool["metadata"]["namespace"]
    spec = pod.get("spec") or {}
    index = find_vllm_container(pod)
    vllm = spec["containers"][index]
    where = f"the vLLM container {vllm.get('name')!r}"
    connector = kv_transfer.injected_connector(pool.get("spec") or {})
    injection: dict[str, list[str]] = {}
    if kv_transfer.needs_injection(container_argv(vllm), connector, where):
        assert connector is not None
        injection = kv_transfer.container_injection(vllm, connector, where)
        vllm = {**vllm, **injection}  # the container as it will run
    try:
        dp_indices = pod_dp_indices(vllm)
    except ValueError as exc:
        raise ValueError(f"the vLLM arguments of container {vllm.get('name')!r} do not parse: {exc}") from None
    sidecar = pod_defaults.for_pod(sidecar, vllm, parse_vllm_args(container_argv(vllm)))
    problem = pod_host.host_namespace_problem(pod, effective_ucx_tls(sidecar))
    if problem is not None:
        raise ValueError(problem)
    shm_bytes = pod_host.shm_size_limit(sidecar, pod_host.primary_tier_bytes(container_argv(vllm)),
                                        len(dp_indices))
    existing_shm = _existing_shm_volume(vllm)
    shm_volume = existing_shm or SHM_VOLUME
    ops: list[dict[str, Any]] = []
    meta = pod.get("metadata") or {}
    if "annotations" not in meta:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    ops.append({"op": "add", "path": f"/metadata/annotations/{_escape(INJECTED_ANNOTATION)}",
                "value": fingerprint})

    def append_all(path: str, present: bool, items: list[dict[str, Any]]) -> None:
        if not items:
            return
        if not present:
            ops.append({"op": "add", "path": path, "value": items})
        else:
            ops.extend({"op": "add", "path": f"{path}/-", "value": item} for item in items)

    inits = [tier_init_container(sidecar),
             sidecar_container(pool_name=pool_name, namespace=namespace, sidecar=sidecar,
                               dp_indices=dp_indices, shm_volume=shm_volume, pod=pod)]
    append_all("/spec/initContainers", "initContainers" in spec, inits)
    append_all("/spec/volumes", "volumes" in spec,
               pod_volumes(pool_name, sidecar, with_shm=existing_shm is None, shm_bytes=shm_bytes))
    resize = pod_host.own_shm_resize(pod, existing_shm, shm_bytes) if existing_shm else None
    if resize is not None:  # the pod's own /dev/shm must hold the store and vLLM's primary tier
        ops.append({"op": "replace", "path": f"/spec/volumes/{resize[0]}/emptyDir/sizeLimit", "value": resize[1]})
    append_all("/spec/resourceClaims", "resourceClaims" in spec, pod_host.pod_resource_claims(pod, sidecar))
    base = f"/spec/containers/{index}"
    for key, value in injection.items():  # our --kv-transfer-config (spec.injectKVTransferConfig)
        ops.append({"op": "add", "path": f"{base}/{key}", "value": value})
    ops.append({"op": "add", "path": f"{base}/env", "value": _vllm_env(vllm, sidecar, pool_name)})
    mounts = [{"name": TIER_VOLUME, "mountPath": TIER_DIR, "readOnly": True}]
    if existing_shm is None:
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_DIR})
    append_all(f"{base}/volumeMounts", "volumeMounts" in vllm, mounts)
    return ops


def effective_ucx_tls(sidecar: SidecarSpec) -> str | None:
    """The sidecar's UCX_TLS: a plain spec.sidecar.env value, else the ucxTransports preset;
    None with the tcp transport (no UCX)."""
    if sidecar.transport != "ucx":
        return None
    for e in sidecar.env:
        if e.get("name") == "UCX_TLS" and "value" in e:
            return str(e["value"])
    return sidecar.ucx_tls


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
