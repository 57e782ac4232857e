"""The self-managed webhook certificate survives upgrades: Helm's `lookup` reuses the Secret.

`helm template --dry-run=server` renders against an API server, which makes
`lookup` real. The API server here is kmock's in-memory Kubernetes emulator
on 127.0.0.1 (core and built-in API discovery from its bundled resource list).
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from chart_support import (
    CHART,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    find,
    load_documents,
    tool_path,
)

SECRET = f"{FULLNAME}-webhook-tls"
SECRETS_URL = f"/api/v1/namespaces/{NAMESPACE}/secrets"


@pytest.fixture
async def api_server(kmock: Any, tmp_path: Path) -> Path:
    """A Kubernetes 1.31 emulator; returns a kubeconfig pointing at it."""
    kmock.resources.load_bundled()
    kmock["get /version"] << {"major": "1", "minor": "31", "gitVersion": "v1.31.0",
                              "platform": "linux/amd64"}
    url = str(kmock.url).rstrip("/")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/api/v1") as reply:
            core = await reply.json()
    # kmock 0.8 reports the core group as "/v1", which client-go cannot parse.
    core["groupVersion"] = "v1"
    kmock["get /api/v1"] << core
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emulator, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: tester, user: {}}]\n"
        "contexts: [{name: emulator, context: {cluster: emulator, user: tester}}]\n"
        "current-context: emulator\n")
    return kubeconfig


async def render_against(kubeconfig: Path) -> list[dict[str, Any]]:
    """`helm template --dry-run=server`: templates see the emulator's objects through lookup."""
    proc = await asyncio.create_subprocess_exec(
        tool_path("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(kubeconfig),
        "--show-only", "templates/webhook.yaml",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    return load_documents(out.decode())


async def store_as_previous_release(kmock: Any, secret: dict[str, Any]) -> None:
    """Put the Secret into the emulator as an earlier install of this release left it."""
    secret = {**secret, "metadata": {
        **secret["metadata"],
        "labels": {**secret["metadata"].get("labels", {}), "app.kubernetes.io/managed-by": "Helm"},
        "annotations": {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}}}
    async with aiohttp.ClientSession() as session:
        async with session.post(str(kmock.url).rstrip("/") + SECRETS_URL, json=secret) as reply:
            assert reply.status in (200, 201), await reply.text()


def tls_of(objects: list[dict[str, Any]]) -> tuple[dict[str, str], str]:
    secret = find(objects, "Secret", SECRET)
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    return secret["data"], hook["clientConfig"]["caBundle"]


async def test_upgrade_reuses_the_certificate_already_in_the_cluster(kmock, api_server):
    first = await render_against(api_server)
    first_data, first_bundle = tls_of(first)
    assert first_bundle == first_data["ca.crt"]
    await store_as_previous_release(kmock, find(first, "Secret", SECRET))
    upgraded_data, upgraded_bundle = tls_of(await render_against(api_server))
    assert upgraded_data == first_data
    assert upgraded_bundle == first_bundle


async def test_fresh_install_generates_a_new_ca_each_time(api_server):
    (a_data, _), (b_data, _) = [tls_of(await render_against(api_server)) for _ in range(2)]
    assert a_data["ca.crt"] != b_data["ca.crt"]


async def test_incomplete_secret_in_the_cluster_is_replaced_by_a_new_certificate(kmock, api_server):
    half = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": SECRET, "namespace": NAMESPACE},
            "data": {"ca.crt": base64.b64encode(b"old ca").decode()}}
    await store_as_previous_release(kmock, half)
    data, bundle = tls_of(await render_against(api_server))
    assert set(data) == {"ca.crt", "tls.crt", "tls.key"}
    assert base64.b64decode(bundle).startswith(b"-----BEGIN CERTIFICATE-----")
