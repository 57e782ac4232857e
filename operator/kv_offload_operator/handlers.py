"""The kopf handlers of the kv-offload operator: thin glue over pure builders.

A ``KVOffloadPool`` becomes a ConfigMap (``offloading_config.json``), a
pool-key Secret (created once, never rotated) and a headless peer Service,
all owned by the pool; its status carries the fingerprint, the ready peer
count and the ``Ready``/``Invalid`` conditions. The mutating webhook wires
labelled pods into their pool. Translation lives in ``translate.py``, every
object shape in ``resources.py``; this module only moves them through the
API (kubernetes_asyncio) and kopf.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from . import resources as r
from .translate import translate

MERGE_PATCH = "application/merge-patch+json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorOptions:
    """Command-line settings handed to the startup handler through ``memo.options``."""

    # Sidecar image for pools that do not name one in spec.sidecar.image.
    sidecar_image: str
    # Webhook listening address ("0.0.0.0" = all interfaces).
    webhook_addr: str = "0.0.0.0"
    # Webhook HTTPS port.
    webhook_port: int = 9443
    # Host name put into the self-signed dev certificate and the logged URL; None = addr.
    webhook_host: str | None = None
    # Directory with tls.crt and tls.key (e.g. a cert-manager Secret); None = self-signed (dev).
    webhook_cert_dir: str | None = None
    # Seconds between checks of tls.crt/tls.key for a renewed pair (> 0).
    webhook_cert_check_seconds: float = 10.0
    # Seconds between re-reads of each pool's modelConfigRef ConfigMap (> 0).
    model_config_check_seconds: float = 60.0


class PoolSpecError(ValueError):
    """A pool spec that can never work; its message says what to change."""


# ---- settings ---------------------------------------------------------------

@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo,
                    logger: logging.Logger, **_: Any) -> None:
    """All operator settings, the webhook server and the API client, in one place."""
    options: OperatorOptions = memo.options
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=r.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=r.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{r.GROUP}/finalizer"
    # Only problems become Kubernetes Events (kubectl describe kvoffloadpool ...).
    settings.posting.level = logging.WARNING
    # One replica; no peering objects, no CRD scanning: least RBAC.
    settings.peering.standalone = True
    settings.peering.mandatory = False
    settings.scanning.disabled = True
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    settings.admission.server = _webhook_server(options, memo, logger)
    memo.api = await _api_client()
    memo.ready_counts = {}
    memo.model_config_refs = {}
    memo.model_config_follower = asyncio.create_task(_follow_model_configs(memo), name="model-config-follower")


@kopf.on.cleanup()
async def shut_down(memo: kopf.Memo, **_: Any) -> None:
    """Stop following model ConfigMaps, close the API client, delete a self-signed dev key."""
    follower = getattr(memo, "model_config_follower", None)
    if follower is not None:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    self_signed = getattr(memo, "self_signed_dir", None)
    if self_signed is not None:
        shutil.rmtree(self_signed, ignore_errors=True)


async def _api_client() -> k8s.ApiClient:
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        try:
            await k8s_config.load_kube_config(client_configuration=cfg)
        except (k8s_config.ConfigException, OSError) as exc:
            raise kopf.PermanentError(f"no Kubernetes credentials: neither in-cluster nor "
                                      f"$KUBECONFIG/~/.kube/config work ({exc})") from None
    return k8s.ApiClient(cfg)


def _webhook_server(options: OperatorOptions, memo: kopf.Memo, logger: logging.Logger) -> kopf.WebhookServer:
    if options.webhook_cert_dir:
        cert_dir = Path(options.webhook_cert_dir)
        certfile, keyfile = cert_dir / "tls.crt", cert_dir / "tls.key"
        for f in (certfile, keyfile):
            if not f.is_file():
                raise kopf.PermanentError(f"--webhook-cert-dir {cert_dir}: {f.name} is missing")
    else:
        logger.warning("No --webhook-cert-dir: serving the webhook with a self-signed certificate (dev only).")
        certfile, keyfile = _self_signed(options)
        memo.self_signed_dir = certfile.parent
    return CertFollowingWebhookServer(addr=options.webhook_addr, port=options.webhook_port,
                                      host=options.webhook_host, certfile=str(certfile), pkeyfile=str(keyfile),
                                      check_seconds=options.webhook_cert_check_seconds)


# kopf's own file check would restart the listener (and fail on a half-written pair); never let it.
_KOPF_FILE_CHECK_SECONDS = 365 * 24 * 3600.0


class CertFollowingWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server whose certificate follows tls.crt/tls.key on disk.

    cert-manager and the kubelet renew the mounted Secret in place. Every
    ``check_seconds`` the pair is re-read; a changed pair is first loaded into
    a scratch SSL context (so a half-written pair, whose key does not match its
    certificate, is skipped until it is whole) and then into the live context:
    new connections get the new certificate, the listener never restarts.
    """

    def __init__(self, *, certfile: str, pkeyfile: str, check_seconds: float, **kwargs: Any) -> None:
        if not check_seconds > 0:
            raise ValueError(f"check_seconds={check_seconds!r} must be positive")
        super().__init__(certfile=certfile, pkeyfile=pkeyfile,
                         context=ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH),
                         file_check_interval=_KOPF_FILE_CHECK_SECONDS, **kwargs)
        self.check_seconds = check_seconds

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        serving = asyncio.current_task()
        follower = asyncio.create_task(self._follow_cert_files(), name="webhook-cert-follower")

        def stop_serving_if_failed(task: asyncio.Task[None]) -> None:
            if serving is not None and not task.cancelled() and task.exception() is not None:
                serving.cancel()  # below, the cancellation becomes the follower's error

        follower.add_done_callback(stop_serving_if_failed)
        try:
            async for client_config in super().__call__(fn):
                yield client_config
        except asyncio.CancelledError:
            failure = follower.exception() if follower.done() and not follower.cancelled() else None
            if failure is None:
                raise
            # The live context may hold a half-loaded pair: stop the operator (exit 1, restarted).
            raise RuntimeError(f"the webhook certificate could not be loaded into the live TLS context "
                               f"({failure}); exiting so that the operator is restarted") from failure
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    def _read_pair(self) -> tuple[bytes, bytes]:
        with open(str(self.certfile), "rb") as cert, open(str(self.pkeyfile), "rb") as key:
            return cert.read(), key.read()

    async def _follow_cert_files(self) -> None:
        logger = logging.getLogger("kv_offload_operator.webhook")
        loaded: tuple[bytes, bytes] | None = None  # None: reload once, whatever kopf read at start
        while True:
            await asyncio.sleep(self.check_seconds)
            try:
                pair = self._read_pair()
                if pair == loaded:
                    continue
                _load_pem_pair(ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH), *pair)
            except (OSError, ssl.SSLError, ValueError) as exc:
                logger.warning(f"Webhook certificate {self.certfile} not (re)loaded yet: {exc}; retrying.")
                continue
            assert self.context is not None
            _load_pem_pair(self.context, *pair)
            loaded = pair
            logger.info(f"Webhook certificate loaded from {self.certfile}: sha256:{_cert_sha256(pair[0])}.")


def _cert_sha256(pem: bytes) -> str:
    """SHA-256 of the first certificate's DER (as `openssl x509 -fingerprint -sha256`)."""
    found = re.search(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", pem, re.S)
    return hashlib.sha256(base64.b64decode(found.group(1))).hexdigest() if found else "unknown"


def _load_pem_pair(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """Load PEM bytes into ``context`` through memory files: exactly the bytes
    that were checked, and the key never touches a (read-only) disk."""
    fds = [os.memfd_create("kv-offload-webhook-tls", os.MFD_CLOEXEC) for _ in range(2)]
    try:
        for fd, data in zip(fds, (cert, key)):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)


def _self_signed(options: OperatorOptions) -> tuple[Path, Path]:
    """A throw-away certificate for development clusters (cryptography, not certbuilder)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    names = [n for n in (options.webhook_host, options.webhook_addr, "localhost") if n]
    sans: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            ip = ipaddress.ip_address(n)
        except ValueError:
            sans.append(x509.DNSName(n))
        else:
            if not ip.is_unspecified:
                sans.append(x509.IPAddress(ip))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, options.webhook_host or "kv-offload-webhook")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    out = Path(tempfile.mkdtemp(prefix="kv-offload-webhook-"))
    (out / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                     serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return out / "tls.crt", out / "tls.key"


# ---- ready peers ------------------------------------------------------------

def _pod_is_ready(status: Mapping[str, Any], **_: Any) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (status or {}).get("conditions") or [])


@kopf.index("pods", labels={r.POOL_LABEL: kopf.PRESENT}, when=_pod_is_ready)
def ready_pool_pods(namespace: str, name: str, labels: Mapping[str, str], **_: Any) -> dict[tuple[str, str], str]:
    """Ready pool pods by (namespace, pool name)."""
    return {(namespace, labels[r.POOL_LABEL]): name}


@kopf.on.event("pods", labels={r.POOL_LABEL: kopf.PRESENT})
async def count_ready_peers(namespace: str, labels: Mapping[str, str], memo: kopf.Memo,
                            ready_pool_pods: kopf.Index, **_: Any) -> None:
    """Write the pool's ``status.readyPeers`` whenever the count changes."""
    pool = labels[r.POOL_LABEL]
    key = (namespace, pool)
    count = len(ready_pool_pods.get(key, []))
    if memo.ready_counts.get(key) == count:
        return
    try:
        await k8s.CustomObjectsApi(memo.api).patch_namespaced_custom_object_status(
            r.GROUP, r.VERSION, namespace, r.PLURAL, pool, {"status": {"readyPeers": count}},
            _content_type=MERGE_PATCH)
    except ApiException as exc:
        if exc.status == 404:
            return  # a pod naming a pool that does not exist; the webhook denies new ones
        raise
    memo.ready_counts[key] = count


# ---- the pool ---------------------------------------------------------------

@kopf.on.resume(r.GROUP, r.VERSION, r.PLURAL)
@kopf.on.create(r.GROUP, r.VERSION, r.PLURAL)
@kopf.on.update(r.GROUP, r.VERSION, r.PLURAL, field="spec")
async def reconcile_pool(body: kopf.Body, meta: kopf.Meta, status: kopf.Status,
                         name: str, namespace: str, patch: kopf.Patch, memo: kopf.Memo,
                         logger: logging.Logger, ready_pool_pods: kopf.Index, **_: Any) -> None:
    """Translate the pool and write its ConfigMap, Secret, Service and status."""
    await _reconcile(body, meta, status, name, namespace, patch, memo, logger,
                     len(ready_pool_pods.get((namespace, name), [])))


# ---- model ConfigMaps named by pools ---------------------------------------------

@kopf.on.event(r.GROUP, r.VERSION, r.PLURAL)
async def track_model_config_refs(event: kopf.RawEvent, namespace: str, name: str, spec: kopf.Spec,
                                  memo: kopf.Memo, **_: Any) -> None:
    """Remember which pools read their model config from a ConfigMap (for the follower)."""
    key = (namespace, name)
    if event.get("type") == "DELETED" or not spec.get("modelConfigRef"):
        memo.model_config_refs.pop(key, None)
    else:
        memo.model_config_refs[key] = True


async def _follow_model_configs(memo: kopf.Memo) -> None:
    """Every ``--model-config-check-seconds``, re-read the ConfigMap each pool's
    ``spec.modelConfigRef`` names and translate the pool again when its content differs
    from what was last translated (``status.modelConfigDigest``), so an edited model
    config reaches the pool's ConfigMap and fingerprint without a spec change or an
    operator restart. A task started at startup rather than a kopf timer (a timer would
    put a finalizer on every pool) or a ConfigMap watch (cluster-wide list/watch on
    ConfigMaps): it only ``get``s one ConfigMap and one pool per pool and interval."""
    interval = memo.options.model_config_check_seconds
    while True:
        await asyncio.sleep(interval)
        for namespace, name in list(memo.model_config_refs):
            try:
                await _recheck_model_config(memo, namespace, name)
            except asyncio.CancelledError:
                raise
            except Exception:  # one pool's API trouble must not stop the others
                log.exception(f"Pool {namespace}/{name}: re-reading its model config failed")


async def _recheck_model_config(memo: kopf.Memo, namespace: str, name: str) -> None:
    api: k8s.ApiClient = memo.api
    objects = k8s.CustomObjectsApi(api)
    try:
        body = await objects.get_namespaced_custom_object(r.GROUP, r.VERSION, namespace, r.PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            memo.model_config_refs.pop((namespace, name), None)
            return
        raise
    spec, status = body.get("spec") or {}, body.get("status") or {}
    if not spec.get("modelConfigRef"):
        return
    try:
        text = await _model_config_text(api, namespace, spec)
    except (ValueError, kopf.TemporaryError):
        return  # gone or keyless: the pool keeps its last translation (running pods are unaffected)
    if _digest(text) == status.get("modelConfigDigest"):
        return
    log.info(f"Pool {namespace}/{name}: its modelConfigRef ConfigMap changed; translating again.")
    patch = kopf.Patch()
    try:
        await _reconcile(body, body.get("metadata") or {}, status, name, namespace, patch, memo, log,
                         memo.ready_counts.get((namespace, name), 0))
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        log.warning(f"Pool {namespace}/{name}: {exc}")
    if patch.status:
        await objects.patch_namespaced_custom_object_status(
            r.GROUP, r.VERSION, namespace, r.PLURAL, name, {"status": dict(patch.status)},
            _content_type=MERGE_PATCH)


def _digest(text: str) -> str:
    """Short content digest of a model config as read (status.modelConfigDigest)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


async def _reconcile(body: Mapping[str, Any], meta: Mapping[str, Any], status: Mapping[str, Any],
                     name: str, namespace: str, patch: kopf.Patch, memo: kopf.Memo,
                     logger: logging.Logger | logging.LoggerAdapter, ready_count: int) -> None:
    """Translate the pool and write its children; the status goes to ``patch.status``
    (also when it raises: PermanentError for a spec that can never work, TemporaryError
    while something it needs does not exist yet)."""
    api: k8s.ApiClient = memo.api
    generation = meta.get("generation")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    pool = json.loads(json.dumps(dict(body)))
    try:
        model_config = await _model_config(api, namespace, pool["spec"], patch)
        config = translate(list(pool["spec"].get("vllmArgs") or []), model_config)
        sidecar = r.SidecarSpec.from_pool(pool, default_image=memo.options.sidecar_image)
        seed_problem = r.pool_hash_seed_problem(config, sidecar.hash_seed)
        if seed_problem is not None:
            raise PoolSpecError(seed_problem)
    except ValueError as exc:  # TranslationError, PoolSpecError, bad sidecar values
        message = str(exc)
        patch.status["conditions"] = r.pool_conditions(
            status.get("conditions"), invalid_message=message, generation=generation, now=now)
        patch.status["observedGeneration"] = generation
        raise kopf.PermanentError(message) from None
    except kopf.TemporaryError as exc:  # e.g. the modelConfigRef ConfigMap does not exist yet
        patch.status["conditions"] = r.pool_conditions(
            status.get("conditions"), invalid_message=None, waiting_message=str(exc),
            generation=generation, now=now)
        raise

    core = k8s.CoreV1Api(api)
    await _ensure_configmap(core, r.configmap_for(pool, config))
    try:
        await _ensure_pool_key(core, pool)
    except kopf.TemporaryError as exc:
        patch.status["conditions"] = r.pool_conditions(
            status.get("conditions"), invalid_message=None, waiting_message=str(exc),
            generation=generation, now=now)
        raise
    await _ensure_service(core, r.peers_service(pool, r.pool_ports(config, sidecar)))

    count = ready_count
    memo.ready_counts[(namespace, name)] = count
    patch.status["fingerprint"] = config.fingerprint
    patch.status["namespaceDigest"] = config.namespace_digest
    patch.status["configMap"] = r.configmap_name(name)
    patch.status["readyPeers"] = count
    patch.status["observedGeneration"] = generation
    patch.status["conditions"] = r.pool_conditions(
        status.get("conditions"), invalid_message=None, generation=generation, now=now)
    logger.info(f"Pool {namespace}/{name}: fingerprint {config.fingerprint}, "
                f"ConfigMap {r.configmap_name(name)} written.")


async def _model_config(api: k8s.ApiClient, namespace: str, spec: Mapping[str, Any],
                        patch: kopf.Patch | None = None) -> Mapping[str, Any]:
    """The model's config.json, inline or from the modelConfigRef ConfigMap (whose content
    digest goes to ``patch.status.modelConfigDigest``, valid or not, for the follower)."""
    if "modelConfig" in spec and "modelConfigRef" in spec:
        raise PoolSpecError("set only one of spec.modelConfig or spec.modelConfigRef")
    if "modelConfig" in spec:
        return spec["modelConfig"]
    text = await _model_config_text(api, namespace, spec)
    if patch is not None:
        patch.status["modelConfigDigest"] = _digest(text)
    ref = spec["modelConfigRef"]
    key = ref.get("key") or "config.json"
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PoolSpecError(f"ConfigMap {ref['name']!r} key {key!r} is not JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise PoolSpecError(f"ConfigMap {ref['name']!r} key {key!r} must hold a JSON object (config.json)")
    return loaded


async def _model_config_text(api: k8s.ApiClient, namespace: str, spec: Mapping[str, Any]) -> str:
    """The text under the modelConfigRef ConfigMap's key; PoolSpecError / TemporaryError
    (the ConfigMap does not exist yet) saying what to change."""
    ref = spec.get("modelConfigRef")
    if not ref or not ref.get("name"):
        raise PoolSpecError("set spec.modelConfig (the model's config.json) or spec.modelConfigRef.name")
    key = ref.get("key") or "config.json"
    try:
        cm = await k8s.CoreV1Api(api).read_namespaced_config_map(ref["name"], namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise kopf.TemporaryError(f"ConfigMap {ref['name']!r} named by spec.modelConfigRef does not exist "
                                      f"in namespace {namespace!r}; waiting for it", delay=30) from None
        raise
    text = (cm.data or {}).get(key)
    if text is None:
        raise PoolSpecError(f"ConfigMap {ref['name']!r} has no key {key!r} (spec.modelConfigRef.key)")
    return str(text)


async def _read(reader: Any, name: str, namespace: str) -> Any | None:
    try:
        return await reader(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def _create(creator: Any, namespace: str, obj: Mapping[str, Any]) -> None:
    try:
        await creator(namespace, obj)
    except ApiException as exc:
        if exc.status != 409:  # created meanwhile (e.g. a restarted operator): keep it
            raise


async def _ensure_configmap(core: k8s.CoreV1Api, cm: Mapping[str, Any]) -> None:
    meta = cm["metadata"]
    current = await _read(core.read_namespaced_config_map, meta["name"], meta["namespace"])
    if current is None:
        await _create(core.create_namespaced_config_map, meta["namespace"], cm)
    elif (current.data or {}) != cm["data"]:
        await core.patch_namespaced_config_map(
            meta["name"], meta["namespace"],
            {"data": cm["data"], "metadata": {"ownerReferences": meta["ownerReferences"]}},
            _content_type=MERGE_PATCH)


async def _ensure_pool_key(core: k8s.CoreV1Api, pool: Mapping[str, Any]) -> None:
    name, namespace = r.secret_name(pool["metadata"]["name"]), pool["metadata"]["namespace"]
    current = await _read(core.read_namespaced_secret, name, namespace)
    if current is None:
        secret = r.pool_key_secret(pool, secrets.token_bytes(r.POOL_KEY_BYTES))
        await _create(core.create_namespaced_secret, namespace, secret)
    elif not (current.data or {}).get(r.POOL_KEY_KEY):
        raise kopf.TemporaryError(f"Secret {name!r} exists without key {r.POOL_KEY_KEY!r}; the operator never "
                                  f"rotates a pool key silently: delete the Secret to get a new one", delay=60)


async def _ensure_service(core: k8s.CoreV1Api, svc: Mapping[str, Any]) -> None:
    meta = svc["metadata"]
    current = await _read(core.read_namespaced_service, meta["name"], meta["namespace"])
    if current is None:
        await _create(core.create_namespaced_service, meta["namespace"], svc)
        return
    have = core.api_client.sanitize_for_serialization(current.spec) or {}
    want = svc["spec"]
    have_ports = [{k: p.get(k) for k in ("name", "port", "targetPort")} for p in have.get("ports") or []]
    want_ports = [{k: p.get(k) for k in ("name", "port", "targetPort")} for p in want["ports"]]
    if have.get("selector") != want["selector"] or have_ports != want_ports:
        await core.patch_namespaced_service(
            meta["name"], meta["namespace"],
            {"spec": {"selector": want["selector"], "ports": want["ports"]}}, _content_type=MERGE_PATCH)


# ---- the webhook --------------------------------------------------------------

@kopf.on.mutate("pods", labels={r.POOL_LABEL: kopf.PRESENT}, operations={"CREATE"})
async def inject_sidecar(body: kopf.Body, labels: Mapping[str, str], namespace: str | None,
                         patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Wire a labelled pod into its pool; deny it when the pool is missing or Invalid."""
    pool_name = labels[r.POOL_LABEL]
    pod = json.loads(json.dumps(dict(body)))
    namespace = namespace or "default"
    if r.is_injected(pod):
        return
    try:
        pool = await k8s.CustomObjectsApi(memo.api).get_namespaced_custom_object(
            r.GROUP, r.VERSION, namespace, r.PLURAL, pool_name)
    except ApiException as exc:
        if exc.status == 404:
            raise kopf.AdmissionError(
                f"KVOffloadPool {pool_name!r} does not exist in namespace {namespace!r}: create it, "
                f"or fix the pod's label {r.POOL_LABEL}.", code=400) from None
        raise kopf.AdmissionError(
            f"The kv-offload operator could not read KVOffloadPool {pool_name!r} in namespace "
            f"{namespace!r} (HTTP {exc.status} {exc.reason}); check the operator's RBAC and namespaces.",
            code=500) from None
    problem = r.invalid_message(pool)
    if problem is not None:
        raise kopf.AdmissionError(
            f"KVOffloadPool {pool_name!r} in namespace {namespace!r} is Invalid ({problem}); "
            f"fix the pool's spec before creating its pods.", code=400)
    fingerprint = (pool.get("status") or {}).get("fingerprint")
    if not fingerprint:
        raise kopf.AdmissionError(
            f"KVOffloadPool {pool_name!r} in namespace {namespace!r} has no translated config yet; "
            f"retry once the operator has set its status.fingerprint.", code=503)
    try:
        model_config = await _model_config(memo.api, namespace, pool["spec"])
        pool_config = translate(list(pool["spec"].get("vllmArgs") or []), model_config)
    except (ValueError, kopf.TemporaryError) as exc:
        raise kopf.AdmissionError(
            f"KVOffloadPool {pool_name!r} in namespace {namespace!r} cannot be read back ({exc}); "
            f"retry once the operator has reconciled it.", code=503) from None
    if pool_config.fingerprint != fingerprint:
        raise kopf.AdmissionError(
            f"KVOffloadPool {pool_name!r} in namespace {namespace!r} is being updated (its spec gives "
            f"fingerprint {pool_config.fingerprint}, its status still {fingerprint}); retry in a moment.",
            code=503)
    try:
        problem = r.pod_identity_problem(pod, pool_config, model_config)
        sidecar = r.SidecarSpec.from_pool(pool, default_image=memo.options.sidecar_image)
        ops = r.pod_patch(pod, pool, fingerprint=fingerprint, sidecar=sidecar)
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        raise kopf.AdmissionError(
            f"The pod cannot join KVOffloadPool {pool_name!r} in namespace {namespace!r}: {problem}.",
            code=400)
    patch.fns.append(lambda raw: r.apply_patch(raw, ops))
