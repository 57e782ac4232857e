"""The self-managed webhook certificate: the chart's hook Jobs against an API server.

The chart renders no key material (every render is byte-identical); its
pre-install/pre-upgrade Job creates the TLS Secret once and keeps it on every
upgrade, and its post-install/post-upgrade Job puts the CA into the
MutatingWebhookConfiguration. Here the real `kv-offload webhook-cert` command
runs with exactly the arguments the rendered Jobs give it, against kmock's
Kubernetes emulator on 127.0.0.1 (core and built-in API discovery from its
bundled resource list), as the Jobs' containers would in the cluster.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import ssl
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from chart_support import FULLNAME, NAMESPACE, WEBHOOK_DNS, find, webhook_cert_job_argv
from kv_offload_operator.webhook.certificate import decode_secret_data, new_pair, pair_problem

SECRET = f"{FULLNAME}-webhook-tls"
SECRETS_URL = f"/api/v1/namespaces/{NAMESPACE}/secrets"
WEBHOOKS_URL = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
KV_OFFLOAD = str(Path(sys.executable).with_name("kv-offload"))
pytestmark = pytest.mark.timeout(240)


@pytest.fixture
async def api_server(kmock: Any, tmp_path: Path) -> Path:
    """A Kubernetes 1.31 emulator; returns a kubeconfig pointing at it."""
    kmock.resources.load_bundled()
    kmock["get /version"] << {"major": "1", "minor": "31", "gitVersion": "v1.31.0",
                              "platform": "linux/amd64"}
    url = str(kmock.url).rstrip("/")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emulator, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: tester, user: {token: job-token}}]\n"
        "contexts: [{name: emulator, context: {cluster: emulator, user: tester}}]\n"
        "current-context: emulator\n")
    return kubeconfig


async def run_job(objects: list[dict[str, Any]], step: str, kubeconfig: Path) -> tuple[int, str, str]:
    """The rendered Job's container command, run here; (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *webhook_cert_job_argv(objects, step), env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return int(proc.returncode or 0), out.decode(), err.decode()


async def post(kmock: Any, url: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(str(kmock.url).rstrip("/") + url, json=body) as reply:
            assert reply.status in (200, 201), await reply.text()


async def get(kmock: Any, url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.get(str(kmock.url).rstrip("/") + url) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()


def dns_names(objects: list[dict[str, Any]]) -> list[str]:
    (container,) = find(objects, "Job", f"{FULLNAME}-webhook-cert-create")["spec"]["template"]["spec"]["containers"]
    return [a.split("=", 1)[1] for a in container["args"] if a.startswith("--dns-name=")]


def secret_body(pair: dict[str, bytes], **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": SECRET, "namespace": NAMESPACE, **metadata},
            "data": {k: base64.b64encode(v).decode() for k, v in pair.items()}}


async def test_install_creates_a_certificate_the_patch_job_trusts_and_upgrades_keep_it(kmock, api_server, render):
    objects = render()
    await post(kmock, WEBHOOKS_URL, find(objects, "MutatingWebhookConfiguration"))  # as Helm applies it

    code, out, err = await run_job(objects, "create", api_server)  # pre-install
    assert code == 0, err
    assert out.strip().startswith(f"Secret {NAMESPACE}/{SECRET}: created a new CA and serving certificate")
    secret = await get(kmock, f"{SECRETS_URL}/{SECRET}")
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == "kvo"
    pair = decode_secret_data(secret["data"])
    assert WEBHOOK_DNS in dns_names(objects) and pair_problem(pair, dns_names(objects)) is None

    code, out, err = await run_job(objects, "patch", api_server)  # post-install
    assert code == 0, err
    (hook,) = (await get(kmock, f"{WEBHOOKS_URL}/{FULLNAME}"))["webhooks"]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert hook["clientConfig"]["service"]["path"] == "/inject_sidecar"  # the rest of the webhook is untouched

    # An upgrade renders the same manifests and runs both Jobs again: nothing changes.
    assert render() == objects
    code, out, err = await run_job(objects, "create", api_server)
    assert (code, out.strip()) == (0, f"Secret {NAMESPACE}/{SECRET}: its certificate serves "
                                      f"{', '.join(dns_names(objects))}; kept as it is."), err
    assert (await get(kmock, f"{SECRETS_URL}/{SECRET}"))["data"] == secret["data"]
    code, out, err = await run_job(objects, "patch", api_server)
    assert code == 0 and "caBundle already current" in out, err


@pytest.mark.parametrize("stored, problem", [
    ({"ca.crt": b"old ca"}, "it has no tls.crt, tls.key"),
    (new_pair("elsewhere", ["other.example.com"], 30), f"tls.crt does not name {FULLNAME}"),
    (new_pair("short", [f"{FULLNAME}", f"{FULLNAME}.{NAMESPACE}", f"{FULLNAME}.{NAMESPACE}.svc",
                        f"{FULLNAME}.{NAMESPACE}.svc.cluster.local"], 10), "within 30 days"),
], ids=["incomplete", "other-names", "expiring"])
async def test_a_secret_that_cannot_serve_is_replaced_saying_why(kmock, api_server, render, stored, problem):
    objects = render()
    await post(kmock, SECRETS_URL, secret_body(stored))
    code, out, err = await run_job(objects, "create", api_server)
    assert code == 0, err
    assert out.startswith(f"Secret {NAMESPACE}/{SECRET}: replaced its certificate (") and problem in out
    pair = decode_secret_data((await get(kmock, f"{SECRETS_URL}/{SECRET}"))["data"])
    assert pair_problem(pair, dns_names(objects)) is None and pair["ca.crt"] != stored["ca.crt"]


async def test_the_secret_an_older_chart_rendered_is_kept_through_the_upgrade_that_stops_rendering_it(
        kmock, api_server, render):
    """The previous chart version rendered the Secret (Helm's lookup); Helm deletes what a new
    manifest leaves out unless the live object says keep, which the pre-upgrade Job adds."""
    objects = render()
    older = new_pair(FULLNAME, dns_names(objects), 3650)
    helm_notes = {"meta.helm.sh/release-name": "kvo", "meta.helm.sh/release-namespace": NAMESPACE}
    await post(kmock, SECRETS_URL, secret_body(older, annotations=helm_notes,
                                               labels={"app.kubernetes.io/managed-by": "Helm"}))
    code, out, err = await run_job(objects, "create", api_server)
    assert code == 0, err
    assert "kept, now annotated" in out
    secret = await get(kmock, f"{SECRETS_URL}/{SECRET}")
    assert decode_secret_data(secret["data"]) == older
    assert secret["metadata"]["annotations"] == {**helm_notes, "helm.sh/resource-policy": "keep"}


async def test_the_api_server_would_complete_a_tls_handshake_with_the_webhook(kmock, api_server, render, tmp_path):
    """A real TLS server with the Job's key pair; a client trusting only the patched caBundle."""
    objects = render()
    await post(kmock, WEBHOOKS_URL, find(objects, "MutatingWebhookConfiguration"))
    for step in ("create", "patch"):
        code, _, err = await run_job(objects, step, api_server)
        assert code == 0, err
    pair = decode_secret_data((await get(kmock, f"{SECRETS_URL}/{SECRET}"))["data"])
    (hook,) = (await get(kmock, f"{WEBHOOKS_URL}/{FULLNAME}"))["webhooks"]
    (tmp_path / "tls.crt").write_bytes(pair["tls.crt"])
    (tmp_path / "tls.key").write_bytes(pair["tls.key"])
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_ctx = ssl.create_default_context(cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode())
    assert await asyncio.to_thread(_handshake, server_ctx, client_ctx, WEBHOOK_DNS) == b"ok"
    with pytest.raises(ssl.SSLCertVerificationError):  # the certificate names the Service, nothing else
        await asyncio.to_thread(_handshake, server_ctx, client_ctx, "evil.example.com")


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, name: str) -> bytes:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(20)

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(64)
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=20) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=name) as tls:
                    tls.sendall(b"AdmissionReview")
                    return tls.recv(2)
        finally:
            thread.join(20)


async def test_the_jobs_refuse_bad_flags_and_a_missing_secret_with_one_line(kmock, api_server, render):
    code, out, err = await run_job(render(), "patch", api_server)  # no create ran: no Secret
    assert code == 1 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("kv-offload webhook-cert patch: the API server refused (404")
    proc = await asyncio.create_subprocess_exec(
        KV_OFFLOAD, "webhook-cert", "create", "--namespace", NAMESPACE, "--secret", SECRET,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out_b, err_b = await proc.communicate()
    assert (proc.returncode, out_b) == (2, b"")
    assert err_b.decode().strip() == "kv-offload webhook-cert create: give --dns-name (the webhook Service's names)"
