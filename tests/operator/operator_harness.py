"""Shared set-up for the operator tests: a kmock cluster and a real operator process.

``KubernetesEmulator`` (the ``kmock`` fixture) plays the API server over HTTP;
``OperatorProcess`` runs ``kv-offload operator`` as a separate process against
it through a kubeconfig, exactly as in a cluster. Nothing is patched.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kmock

FIXTURES = Path(__file__).parent / "fixtures_operator"
NAMESPACE = "ns1"
POOLS = "kv-offload.io/v1alpha1/kvoffloadpools"
POOLS_URL = f"/apis/kv-offload.io/v1alpha1/namespaces/{NAMESPACE}/kvoffloadpools"
KTC = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 10737418240}},
                 separators=(",", ":"))
LLAMA_ARGS = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16",
              "--kv-transfer-config", KTC]
SIDECAR_IMAGE = "registry.example/kv-offload:test"
# The installed console script, exactly what a container runs.
KV_OFFLOAD = str(Path(sys.executable).with_name("kv-offload"))


def llama_config() -> dict[str, Any]:
    return json.loads((FIXTURES / "llama-3.1-8b-config.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PEERINGS = "kopf.dev/v1/kopfpeerings"
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def emulate_cluster(k: kmock.KubernetesEmulator) -> None:
    """Declare what discovery must show: our CRD, the core kinds, namespaces, CRDs and kopf's
    peering kinds (the chart installs them; only operators run with --peering use them)."""
    verbs = {"list", "watch", "get", "patch", "create", "delete"}
    k.resources[PEERINGS] = kmock.ResourceInfo(kind="KopfPeering", namespaced=True, verbs=verbs)
    k.resources[CLUSTER_PEERINGS] = kmock.ResourceInfo(kind="ClusterKopfPeering", namespaced=False, verbs=verbs)
    k.resources[POOLS] = kmock.ResourceInfo(kind="KVOffloadPool", namespaced=True, verbs=verbs,
                                            subresources={"status"})
    for plural, kind in (("pods", "Pod"), ("configmaps", "ConfigMap"), ("secrets", "Secret"),
                         ("services", "Service"), ("events", "Event")):
        k.resources[f"v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)
    for plural, kind in (("deployments", "Deployment"), ("statefulsets", "StatefulSet")):
        k.resources[f"apps/v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)
    k.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs=verbs)
    k.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs)


def write_kubeconfig(path: Path, server: str, token: str = "test-token") -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server.rstrip("/")}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}]}))
    return path


def pool_body(name: str, *, vllm_args: Sequence[str] = LLAMA_ARGS, uid: str | None = None,
              model_config: Mapping[str, Any] | None = None, generation: int = 1,
              sidecar: Mapping[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"vllmArgs": list(vllm_args),
                            "modelConfig": dict(model_config or llama_config())}
    if sidecar:
        spec["sidecar"] = dict(sidecar)
    return {"apiVersion": "kv-offload.io/v1alpha1", "kind": "KVOffloadPool",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid or f"uid-{name}",
                         "generation": generation},
            "spec": spec}


async def create(k: kmock.KubernetesEmulator, url: str, body: Mapping[str, Any]) -> None:
    resp = await k.post(url, json=body)
    assert resp.status == 200, await resp.text()


async def merge_patch(k: kmock.KubernetesEmulator, url: str, body: Mapping[str, Any]) -> None:
    resp = await k.patch(url, json=body, headers={"Content-Type": "application/merge-patch+json"})
    assert resp.status == 200, await resp.text()


def obj(k: kmock.KubernetesEmulator, resource: str, name: str,
        namespace: str = NAMESPACE) -> dict[str, Any] | None:
    """The stored object as a plain dict, or None."""
    key = (kmock.resource(resource), namespace, name)
    if key not in k.objects or k.objects[key].deleted:
        return None
    return json.loads(json.dumps(dict(k.objects[key].raw)))


def requests_to(k: kmock.KubernetesEmulator, method: str) -> list[kmock.Request]:
    return [r for r in list(k) if str(r.method.value).upper() == method.upper()]


async def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll ``probe`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


class OperatorProcess:
    """``kv-offload operator`` in its own process, talking to kmock through a kubeconfig."""

    def __init__(self, workdir: Path, server: str, *, extra_args: Sequence[str] = (),
                 scope: Sequence[str] = ("--namespace", NAMESPACE), token: str = "test-token",
                 env: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.kubeconfig = write_kubeconfig(workdir / "kubeconfig", server, token)
        self.health_port = free_port()
        self.webhook_port = free_port()
        self.metrics_port = free_port()
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.scope = list(scope)
        self.proc: asyncio.subprocess.Process | None = None
        self.runs = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.runs}.log"

    async def start(self) -> None:
        self.runs += 1
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1", **self.env)
        log = open(self.log_path, "wb")
        self.proc = await asyncio.create_subprocess_exec(
            KV_OFFLOAD, "operator", *self.scope,
            "--health-port", str(self.health_port), "--webhook-port", str(self.webhook_port),
            "--metrics-port", str(self.metrics_port),
            "--webhook-addr", "127.0.0.1", "--sidecar-image", SIDECAR_IMAGE, "--verbose",
            *self.extra_args, env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return int(self.proc.returncode or 0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def __aenter__(self) -> "OperatorProcess":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        if exc[0] is not None:
            sys.stderr.write(f"--- operator log (run {self.runs}) ---\n{self.log()[-8000:]}\n")


def make_tls(directory: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 in ``directory`` (tls.crt, tls.key); returns ca.crt."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-offload test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-offload-webhook")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return directory / "ca.crt"



def assert_within_rbac(k: kmock.KubernetesEmulator) -> None:
    """Every API request the operator made is allowed by rbac.OPERATOR_RBAC."""
    from kv_offload_operator.rbac import OPERATOR_RBAC

    verbs = {"list": "list", "watch": "watch", "fetch": "get", "create": "create", "delete": "delete"}
    used: set[tuple[str, str, str]] = set()
    for req in list(k):
        if req.resource is None or not req.resource.plural or req.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # discovery, or the test's own requests
        action = str(req.action.value).lower() if req.action is not None else ""
        verb = {"PATCH": "patch", "PUT": "update"}.get(str(req.method.value).upper()) or verbs.get(action, action)
        plural = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        used.add((req.resource.group or "", plural, verb))
    outside = sorted(u for u in used if u[2] not in OPERATOR_RBAC.get((u[0], u[1]), ()))
    assert not outside, f"requests outside OPERATOR_RBAC: {outside}"
