"""The objects the operator writes for a pool, and the pool's status conditions.

Pure builders (no kopf, no I/O): the ConfigMap ``<pool>-offloading-config``
(the pool's ``OffloadingConfig``, the same for every pod, so it holds no
engine's own values), the Secret ``<pool>-pool-key`` (pool key, secret hash
seed, admin token; ``previous-key`` only during a key rotation, see
``key_rotation``) and the headless Service ``<pool>-peers``, each owned by
the pool so they go with it; and the
``Ready``/``Invalid`` conditions of its status (``invalid_message`` reads them
back for the webhook). ``reconcile`` moves them through the API.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig

from ..translation.declared_identity import config_json
from .pool_spec import GROUP, KIND, MAX_HASH_SEED, POOL_LABEL, VERSION, SidecarSpec

# Key of the ConfigMap (and file name in the pod) holding the OffloadingConfig JSON.
CONFIG_KEY = "offloading_config.json"
# Keys of the pool Secret (and file names in the pod). The pool key: HMAC proof between peers.
POOL_KEY_KEY = "key"
# The pool key before the last rotation, present only while the rotation rolls out.
PREVIOUS_KEY_KEY = "previous-key"
# The pool's secret PYTHONHASHSEED (a decimal in [1, MAX_HASH_SEED]), used unless spec.hashSeed is set.
HASH_SEED_KEY = "hash-seed"
# Bearer token of the sidecars' admin endpoints (/v1/status, /v1/peers, /v1/lookup), hex.
ADMIN_TOKEN_KEY = "admin-token"
# Length of a new pool key (random bytes).
POOL_KEY_BYTES = 32
# Random bytes of a new admin token (hex-encoded in the Secret).
ADMIN_TOKEN_BYTES = 32


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
    """DNS name of the pool's headless Service without the cluster domain (clusters are not
    all ``cluster.local``): the sidecar appends its pod's (``peers.cluster_domain``)."""
    return f"{service_name(pool_name)}.{namespace}.svc"


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


def configmap_for(pool: Mapping[str, Any], config: OffloadingConfig,
                  declared: Mapping[str, str]) -> dict[str, Any]:
    """ConfigMap ``<pool>-offloading-config`` with key ``offloading_config.json``.

    ``config`` is the pool's (``translation.translate.pool_config``): every
    pod mounts this one ConfigMap, so it carries no engine's DP index or
    engine id suffix; each pod's DP ranks come from the pod (``--dp-indices``).
    ``declared`` is the model identity its command line states
    (``translation.declared_identity``), written as ``model_identity`` beside the
    fingerprint: each sidecar refuses an engine that contradicts it.
    """
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _child_meta(pool, configmap_name(pool["metadata"]["name"])),
            "data": {CONFIG_KEY: config_json(config, declared)}}


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def new_hash_seed() -> str:
    """A random secret hash seed: a decimal in [1, MAX_HASH_SEED], as PYTHONHASHSEED accepts it."""
    return str(secrets.randbelow(MAX_HASH_SEED) + 1)


def new_admin_token() -> str:
    """A random admin bearer token (hex)."""
    return secrets.token_hex(ADMIN_TOKEN_BYTES)


def pool_key_secret(pool: Mapping[str, Any], key: bytes, *, hash_seed: str | None = None,
                    admin_token: str | None = None,
                    annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Secret ``<pool>-pool-key`` holding ``key`` (random bytes chosen by the caller), the
    secret hash seed and the admin token (new random ones unless given)."""
    if len(key) < 16:
        raise ValueError("pool key must be at least 16 bytes")
    meta = _child_meta(pool, secret_name(pool["metadata"]["name"]))
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta,
            "data": {POOL_KEY_KEY: _b64(key),
                     HASH_SEED_KEY: _b64((hash_seed or new_hash_seed()).encode("ascii")),
                     ADMIN_TOKEN_KEY: _b64((admin_token or new_admin_token()).encode("ascii"))}}


def missing_secret_data(data: Mapping[str, str] | None) -> dict[str, str]:
    """The entries a pool Secret lacks, new and base64-encoded (``{}`` when complete).

    A Secret written by an older operator holds only ``key``: it gets a hash
    seed and an admin token; nothing present is ever replaced, and a missing
    ``key`` is not made up here (the caller refuses that Secret).
    """
    have = data or {}
    missing: dict[str, str] = {}
    if not have.get(HASH_SEED_KEY):
        missing[HASH_SEED_KEY] = _b64(new_hash_seed().encode("ascii"))
    if not have.get(ADMIN_TOKEN_KEY):
        missing[ADMIN_TOKEN_KEY] = _b64(new_admin_token().encode("ascii"))
    return missing


def pool_ports(config: OffloadingConfig, sidecar: SidecarSpec) -> dict[str, int]:
    """Port name -> number of every pool sidecar: one control port per DP rank + data
    (``spec.sidecar.dataPort``); ValueError when the data port is among the control ports.

    These are the peer Service's port names; each pod names its own first
    control port ``kvo-metrics`` instead (``pod_patch.sidecar_ports``).
    """
    dp_size = max(1, config.parallel.data_parallel_size)
    sidecar.check_ports(dp_size)
    ports = {f"kvo-ctrl-{i}": sidecar.control_port(i) for i in range(dp_size)}
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
        wanted = {"Ready": ("True", "ConfigWritten",
                            "The offloading config, pool Secret and peer Service are in place."),
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
