"""The webhook's HTTPS server (tls_server.py) in the running operator: its certificate.

Without ``--webhook-cert-dir`` it serves a self-signed certificate; with one,
a renewed pair is served without a restart and a half-written pair is not.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from pathlib import Path

import aiohttp
import kmock
import pytest
from operator_harness import emulate_cluster
from operator_process import OperatorProcess, make_tls
from waiting import wait_for_async
from webhook_support import Webhook, vllm_pod

pytestmark = pytest.mark.timeout(240)


async def test_without_a_cert_dir_the_webhook_serves_https_with_a_self_signed_certificate(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    async with OperatorProcess(tmp_path, str(kmock.url)) as operator:
        webhook = Webhook(operator.webhook_port, make_tls(tmp_path / "unrelated-ca"))
        await webhook.wait_listening()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await webhook.admit(vllm_pod(None))  # not signed by a CA we trust
        webhook.ssl = ssl.create_default_context()
        webhook.ssl.check_hostname = False
        webhook.ssl.verify_mode = ssl.CERT_NONE
        response = await webhook.admit(vllm_pod(None))
        assert response["allowed"] is True
        assert "self-signed certificate (dev only)" in operator.log()


async def served_certificate(port: int) -> bytes:
    """DER of the certificate the server presents to a new TLS connection."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    try:
        await writer.wait_closed()
    except (ssl.SSLError, ConnectionError):
        pass
    return bytes(der)


def pem_to_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


async def test_a_renewed_certificate_is_served_without_a_restart_and_a_half_written_pair_is_not(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    certs, renewed = tmp_path / "certs", tmp_path / "renewed"
    old_ca = make_tls(certs)
    async with OperatorProcess(tmp_path, str(kmock.url), extra_args=[
            "--webhook-cert-dir", str(certs), "--webhook-cert-check-seconds", "0.2"]) as operator:
        webhook = Webhook(operator.webhook_port, old_ca)
        await webhook.wait_listening()
        assert (await webhook.admit(vllm_pod(None)))["allowed"] is True
        old_der = pem_to_der(certs / "tls.crt")
        assert await served_certificate(operator.webhook_port) == old_der

        # A renewal caught half-way: the new certificate next to the old key.
        new_ca = make_tls(renewed)
        (certs / "tls.crt").write_bytes((renewed / "tls.crt").read_bytes())
        await wait_for_async("the half-written pair to be noticed", lambda: "not (re)loaded yet" in operator.log(), 30)
        assert await served_certificate(operator.webhook_port) == old_der
        assert operator.proc is not None and operator.proc.returncode is None

        # The key arrives: new connections get the new certificate, from the same process.
        (certs / "tls.key").write_bytes((renewed / "tls.key").read_bytes())
        new_der = pem_to_der(renewed / "tls.crt")
        async def serves_the_renewed_certificate() -> bool:
            return await served_certificate(operator.webhook_port) == new_der

        await wait_for_async("the renewed certificate served", serves_the_renewed_certificate)
        assert (await Webhook(operator.webhook_port, new_ca).admit(vllm_pod(None)))["allowed"] is True
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await webhook.admit(vllm_pod(None))  # the old CA no longer vouches for the server
        assert operator.proc.returncode is None and operator.runs == 1
        assert f"sha256:{hashlib.sha256(new_der).hexdigest()}" in operator.log()

