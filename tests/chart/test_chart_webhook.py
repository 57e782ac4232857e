"""The sidecar-injection webhook and its TLS: self-managed by default, cert-manager optional."""

from __future__ import annotations

import base64
import datetime
import socket
import ssl
import threading
from typing import Any

import pytest
from chart_support import FULLNAME, NAMESPACE, WEBHOOK_DNS, find, kinds
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.x509.oid import ExtensionOID


def test_webhook_sends_only_pool_pods_and_fails_closed(render):
    objects = render()
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["objectSelector"] == {"matchExpressions": [{"key": "kv-offload.io/pool",
                                                             "operator": "Exists"}]}
    assert hook["failurePolicy"] == "Fail"
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    service_ref = hook["clientConfig"]["service"]
    service = find(objects, "Service", service_ref["name"])
    assert service_ref["namespace"] == NAMESPACE and service_ref["path"] == "/inject_sidecar"
    port = next(p for p in service["spec"]["ports"] if p["port"] == service_ref["port"])
    assert port["targetPort"] == "webhook"
    pod_labels = find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def _tls_material(objects: list[dict[str, Any]]) -> tuple[bytes, bytes, bytes, bytes]:
    secret = find(objects, "Secret", f"{FULLNAME}-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    return data["ca.crt"], data["tls.crt"], data["tls.key"], base64.b64decode(hook["clientConfig"]["caBundle"])


def test_self_managed_certificate_is_signed_by_the_ca_bundle_and_names_the_service(render):
    ca_pem, cert_pem, _, bundle = _tls_material(render())
    assert bundle == ca_pem
    ca, cert = x509.load_pem_x509_certificate(ca_pem), x509.load_pem_x509_certificate(cert_pem)
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                           cert.signature_hash_algorithm)
    names = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
    assert WEBHOOK_DNS in names.get_values_for_type(x509.DNSName)
    now = datetime.datetime.now(datetime.timezone.utc)
    assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
    assert cert.not_valid_after_utc - now > datetime.timedelta(days=3000)


def test_api_server_would_complete_a_tls_handshake_with_the_webhook(render, tmp_path):
    """A real TLS server with the chart's key pair, a client trusting only the caBundle."""
    _, cert_pem, key_pem, bundle = _tls_material(render())
    (tmp_path / "tls.crt").write_bytes(cert_pem)
    (tmp_path / "tls.key").write_bytes(key_pem)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    port = listener.getsockname()[1]
    served: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            served.append(tls.recv(64))
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cadata=bundle.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=20) as raw:
        with client_ctx.wrap_socket(raw, server_hostname=WEBHOOK_DNS) as tls:
            tls.sendall(b"AdmissionReview")
            assert tls.recv(2) == b"ok"
    thread.join(20)
    listener.close()
    assert served == [b"AdmissionReview"]
    # The same certificate is not valid for another name.
    with socket.create_server(("127.0.0.1", 0)) as other:
        other.settimeout(20)
        worker = threading.Thread(target=lambda: _accept_and_try(other, server_ctx), daemon=True)
        worker.start()
        with socket.create_connection(other.getsockname(), timeout=20) as raw:
            with pytest.raises(ssl.SSLCertVerificationError):
                client_ctx.wrap_socket(raw, server_hostname="evil.example.com")
        worker.join(20)


def _accept_and_try(listener: socket.socket, ctx: ssl.SSLContext) -> None:
    conn, _ = listener.accept()
    try:
        ctx.wrap_socket(conn, server_side=True).close()
    except (ssl.SSLError, OSError):
        conn.close()


def test_cert_manager_mode_issues_a_certificate_from_its_own_ca_and_injects_the_ca(render):
    objects = render({"webhook": {"certManager": {"enabled": True}}})
    assert f"{FULLNAME}-webhook-tls" not in {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    certificates = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Issuer"}
    serving = certificates[f"{FULLNAME}-webhook"]
    ca = certificates[f"{FULLNAME}-ca"]
    # Chain: self-signed Issuer -> CA Certificate -> CA Issuer -> serving Certificate.
    assert ca["spec"]["isCA"] is True
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    assert ca_issuer["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    assert serving["spec"]["issuerRef"]["kind"] == "Issuer"
    assert "isCA" not in serving["spec"] and "server auth" in serving["spec"]["usages"]
    assert WEBHOOK_DNS in serving["spec"]["dnsNames"]
    webhook = find(objects, "MutatingWebhookConfiguration")
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{NAMESPACE}/{serving['metadata']['name']}"
    assert "caBundle" not in webhook["webhooks"][0]["clientConfig"]
    volumes = find(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    tls = next(v for v in volumes if v["name"] == "webhook-tls")
    assert tls["secret"]["secretName"] == serving["spec"]["secretName"]


def test_cert_manager_can_use_an_existing_cluster_issuer(render):
    objects = render("cert-manager.yaml")
    assert "Issuer" not in kinds(objects)
    assert find(objects, "Certificate")["spec"]["issuerRef"] == {
        "name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
