"""The kv-offload chart, rendered by the real `helm` and checked object by object."""

from __future__ import annotations

import base64
import datetime
import json
import socket
import ssl
import subprocess
import sys
import threading
from typing import Any

import pytest
from chart_support import (CHART, FOREIGN_CRD_KINDS, FULLNAME, NAMESPACE, find, kinds,
                           load_documents, schema_errors)
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.x509.oid import ExtensionOID

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema on disk.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
EXAMPLES = sorted(p.name for p in (CHART / "examples").glob("*.yaml"))
ALL_FEATURES = "all-features.yaml"
WEBHOOK_DNS = f"{FULLNAME}.{NAMESPACE}.svc"


# --- lint and schema validation -------------------------------------------------------------

def test_helm_lint_strict_passes_with_defaults_and_every_example(helm):
    for extra in [[]] + [["-f", str(CHART / "examples" / name)] for name in EXAMPLES]:
        result = helm("lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, f"helm lint --strict {extra}: {result.stdout}{result.stderr}"
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLES])
def test_rendered_objects_validate_against_kubernetes_schemas(render, values, kubernetes_version):
    objects = render(*([values] if values else []))
    assert objects
    assert schema_errors(objects, kubernetes_version) == []


def test_all_features_example_turns_every_optional_object_on(render):
    rendered = set(kinds(render(ALL_FEATURES)))
    for kind in ("CustomResourceDefinition", "Deployment", "MutatingWebhookConfiguration",
                 "Certificate", "Issuer", "PodMonitor", "ServiceMonitor", "ConfigMap",
                 "NetworkPolicy", "Role", "RoleBinding", "Pod"):
        assert kind in rendered, f"{kind} missing from the all-features render"
    # The only kinds left out of schema validation are the foreign CRDs, each with its reason.
    skipped = {(o["apiVersion"], o["kind"]) for o in render(ALL_FEATURES)} & FOREIGN_CRD_KINDS.keys()
    assert all(FOREIGN_CRD_KINDS[k] for k in skipped)


def test_schema_validation_catches_an_invalid_object():
    broken = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
              "spec": {"replicas": "one", "selector": {}, "template": {}}}
    errors = schema_errors([broken], KUBERNETES_VERSIONS[-1])
    assert len(errors) == 1 and "Deployment/x" in errors[0]


def test_rendered_yaml_has_no_duplicate_keys():
    with pytest.raises(Exception, match="duplicate key"):
        load_documents("a: 1\na: 2\n")


# --- values.yaml and its schema --------------------------------------------------------------

def test_values_schema_is_the_one_generated_from_values_yaml():
    proc = subprocess.run([sys.executable, str(CHART / "hack" / "gen-schema.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _objects_in(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if schema.get("type") == "object":
        found.append((path or "(top)", schema))
    for key, child in schema.get("properties", {}).items():
        found += _objects_in(child, f"{path}.{key}" if path else key)
    return found


def test_every_values_object_is_closed_or_declared_free_form_and_every_key_explained():
    schema = json.loads((CHART / "values.schema.json").read_text())
    objects = _objects_in(schema)
    assert len(objects) > 10
    free_form = {"operator.resources", "operator.affinity", "operator.podSecurityContext",
                 "operator.containerSecurityContext", "webhook.namespaceSelector"}
    for path, obj in objects:
        if path in free_form:
            assert obj.get("additionalProperties") is True, path
        elif obj.get("additionalProperties") is not False:
            # String maps (labels, annotations, nodeSelector) are open only to strings.
            assert obj["additionalProperties"] == {"type": "string"}, path
        if path != "(top)":
            assert len(obj["description"]) > 20, f"{path} is not explained in values.yaml"


@pytest.mark.parametrize("values, key", [
    ({"operator": {"watchNamespaces": "inference"}}, "watchNamespaces"),
    ({"webhook": {"certmanager": {"enabled": True}}}, "certmanager"),
    ({"imageTag": "0.2.0"}, "imageTag"),
    ({"monitoring": {"podMonitor": {"enable": True}}}, "enable"),
])
def test_misspelled_key_is_rejected_by_helm(render_error, values, key):
    error = render_error(values)
    assert "additional properties" in error and key in error


@pytest.mark.parametrize("values, words", [
    ({"webhook": {"failurePolicy": "Sometimes"}}, "failurePolicy"),
    ({"sidecar": {"controlPort": 70000}}, "controlPort"),
    ({"image": {"digest": "latest"}}, "digest"),
])
def test_value_of_the_wrong_shape_is_rejected_by_helm(render_error, values, words):
    assert words in render_error(values)


@pytest.mark.parametrize("values, sentence", [
    ({"serviceAccount": {"create": False}},
     "serviceAccount.create is false but serviceAccount.name is empty"),
    ({"webhook": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}},
     "issuerRef.kind is ClusterIssuer but issuerRef.name is empty"),
    ({"networkPolicy": {"enabled": True, "monitoringNamespace": ""},
      "monitoring": {"podMonitor": {"enabled": True}}},
     "the NetworkPolicy would block Prometheus"),
    ({"sidecar": {"dataPort": 5712}}, "sidecar.dataPort 5712 lies in the control port range 5710-5717"),
    ({"sidecar": {"controlPort": 65530}}, "is above 65535"),
    ({"networkPolicy": {"enabled": True, "servingPorts": [8000, 5810]}},
     "networkPolicy.servingPorts lists 5810, a sidecar port"),
])
def test_invalid_combination_fails_with_a_sentence(render_error, values, sentence):
    error = render_error(values)
    assert sentence in error
    line = next(l for l in error.splitlines() if sentence in l)
    assert line.rstrip().endswith(".")


# --- the CRD ---------------------------------------------------------------------------------

def test_crd_is_a_kept_template_behind_crds_enabled(render):
    crd = find(render(), "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "kvoffloadpools.kv-offload.io"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "CustomResourceDefinition" not in kinds(render({"crds": {"enabled": False}}))
    unkept = find(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in unkept["metadata"].get("annotations", {})


# --- the operator ----------------------------------------------------------------------------

def test_operator_runs_non_root_read_only_with_resources_and_health_probes(render):
    deployment = find(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"webhook": 9443, "health": 8080}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert deployment["spec"]["replicas"] == 1


def test_operator_command_line_matches_the_values(render):
    deployment = find(render({"operator": {"watchNamespace": "inference"},
                              "image": {"repository": "reg.example/kvo", "tag": "9.9"}}), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "reg.example/kvo:9.9"
    assert container["args"] == [
        "operator", "--namespace=inference", "--webhook-port=9443",
        "--webhook-cert-dir=/etc/kv-offload/webhook-tls", f"--webhook-host={WEBHOOK_DNS}",
        "--health-port=8080", "--sidecar-image=reg.example/kvo:9.9",
    ]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/kv-offload/webhook-tls"] == "webhook-tls" and mounts["/tmp"] == "tmp"
    everywhere = find(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in everywhere


def _granted(objects: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str]]:
    return {(group, resource, verb)
            for role in objects if role["kind"] == kind
            for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}


# What operator/kv_offload_operator/handlers.py uses, and nothing more.
OPERATOR_GRANTS = {
    *{("kv-offload.io", "kvoffloadpools", v) for v in ("get", "list", "watch", "patch")},
    ("kv-offload.io", "kvoffloadpools/status", "patch"),
    *{("", r, v) for r in ("configmaps", "services") for v in ("get", "create", "patch")},
    ("", "secrets", "get"), ("", "secrets", "create"),
    ("", "pods", "list"), ("", "pods", "watch"),
    ("", "events", "create"),
}


def test_rbac_grants_exactly_what_the_operator_uses_cluster_wide(render):
    objects = render()
    assert _granted(objects, "ClusterRole") == OPERATOR_GRANTS
    assert "Role" not in kinds(objects)
    account = find(objects, "ServiceAccount")["metadata"]["name"]
    binding = find(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    find(objects, "ClusterRole", binding["roleRef"]["name"])
    assert find(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_rbac_and_webhook_are_confined_to_the_watched_namespace_when_one_is_set(render):
    objects = render({"operator": {"watchNamespace": "inference"}})
    assert _granted(objects, "Role") == OPERATOR_GRANTS
    assert "ClusterRole" not in kinds(objects) and "ClusterRoleBinding" not in kinds(objects)
    assert find(objects, "Role")["metadata"]["namespace"] == "inference"
    binding = find(objects, "RoleBinding")
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["inference"]}]}
    (everywhere,) = find(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert "namespaceSelector" not in everywhere


def test_existing_service_account_is_used_and_not_created(render):
    objects = render({"serviceAccount": {"create": False, "name": "platform-operator"}})
    assert "ServiceAccount" not in kinds(objects)
    assert find(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == \
        "platform-operator"


# --- the webhook and its TLS -----------------------------------------------------------------

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


def test_cert_manager_mode_issues_a_certificate_and_injects_its_ca(render):
    objects = render({"webhook": {"certManager": {"enabled": True}}})
    assert f"{FULLNAME}-webhook-tls" not in {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    certificate = find(objects, "Certificate")
    issuer = find(objects, "Issuer")
    assert issuer["spec"] == {"selfSigned": {}}
    assert certificate["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                                "group": "cert-manager.io"}
    assert WEBHOOK_DNS in certificate["spec"]["dnsNames"]
    webhook = find(objects, "MutatingWebhookConfiguration")
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{NAMESPACE}/{certificate['metadata']['name']}"
    assert "caBundle" not in webhook["webhooks"][0]["clientConfig"]
    volumes = find(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    tls = next(v for v in volumes if v["name"] == "webhook-tls")
    assert tls["secret"]["secretName"] == certificate["spec"]["secretName"]


def test_cert_manager_can_use_an_existing_cluster_issuer(render):
    objects = render("cert-manager.yaml")
    assert "Issuer" not in kinds(objects)
    assert find(objects, "Certificate")["spec"]["issuerRef"] == {
        "name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


# --- monitoring, dashboards, network policy, notes, helm test -------------------------------

def test_pod_monitor_scrapes_every_pool_pod_and_keeps_the_pool_label(render):
    objects = render({"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}})
    monitor = find(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"] == {"matchExpressions": [{"key": "kv-offload.io/pool",
                                                                  "operator": "Exists"}]}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podTargetLabels"] == ["kv-offload.io/pool"]
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "kvo-ctrl-0", "path": "/metrics",
                                                       "interval": "30s"}]
    assert "PodMonitor" not in kinds(render())


def test_service_monitor_scrapes_the_operator_service(render):
    objects = render({"monitoring": {"serviceMonitor": {"enabled": True}}})
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_dashboard_config_map_carries_the_chart_dashboard_file(render):
    objects = render({"grafana": {"dashboards": {"enabled": True, "namespace": "monitoring"}}})
    config_map = find(objects, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    shipped = json.loads((CHART / "dashboards" / "kv-offload.json").read_text())
    assert json.loads(config_map["data"]["kv-offload.json"]) == shipped
    assert "ConfigMap" not in kinds(render())


def test_network_policy_opens_sidecar_ports_to_pool_pods_and_metrics_to_monitoring(render):
    objects = render({"networkPolicy": {"enabled": True, "namespaces": ["a", "b"],
                                        "openAllPortsBetweenPoolPods": False}})
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["a", "b"]
    pool_pods = {"matchExpressions": [{"key": "kv-offload.io/pool", "operator": "Exists"}]}
    spec = policies[0]["spec"]
    assert spec["podSelector"] == pool_pods and spec["policyTypes"] == ["Ingress"]
    peers, monitoring, serving = spec["ingress"]
    assert peers["from"] == [{"podSelector": pool_pods}]
    assert peers["ports"] == [{"protocol": "TCP", "port": 5710, "endPort": 5717},
                              {"protocol": "TCP", "port": 5810}]
    assert monitoring["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    assert monitoring["ports"] == [{"protocol": "TCP", "port": 5710, "endPort": 5717}]
    assert serving == {"ports": [{"protocol": "TCP", "port": 8000}]}
    default_ns = render({"networkPolicy": {"enabled": True}})
    assert find(default_ns, "NetworkPolicy")["metadata"]["namespace"] == NAMESPACE
    # The default admits every port between pool pods (UCX picks its own ports), from pool pods only.
    all_ports = find(default_ns, "NetworkPolicy")["spec"]["ingress"][0]
    assert all_ports == {"from": [{"podSelector": pool_pods}]}


def test_notes_put_warnings_first_then_one_success_line_then_the_next_step(helm):
    result = helm("install", "kvo", str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                  "--set", "webhook.failurePolicy=Ignore")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1].strip().splitlines()
    assert notes[0].startswith("WARNING: webhook.failurePolicy is Ignore")
    success = [line for line in notes if " is installed in namespace " in line]
    assert len(success) == 1 and notes.index(success[0]) == 1
    assert any(line.startswith("Next:") for line in notes[2:])
    assert any("kv-offload.io/pool" in line for line in notes)
    plain = helm("install", "kvo", str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert "WARNING" not in plain.stdout.split("NOTES:", 1)[1]


def test_helm_test_pod_checks_the_operator_health_endpoint(render):
    objects = render()
    pod = find(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    script = container["command"][-1]
    assert f"http://{WEBHOOK_DNS}:8080/healthz" in script
    assert pod["spec"]["restartPolicy"] == "Never"
    assert "Pod" not in kinds(render({"tests": {"enabled": False}}))


@pytest.mark.parametrize("status, exit_code", [(200, 0), (503, 1)])
def test_helm_test_script_passes_only_when_healthz_answers_200(render, status, exit_code):
    """Run the test pod's own script against a local /healthz (its cluster URL pointed at 127.0.0.1)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(status if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    script = find(render(), "Pod")["spec"]["containers"][0]["command"][-1]
    with ThreadingHTTPServer(("127.0.0.1", 0), Health) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        local = script.replace(f"http://{WEBHOOK_DNS}:8080", f"http://127.0.0.1:{server.server_port}")
        assert local != script
        proc = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=30)
        server.shutdown()
    assert proc.returncode == exit_code, proc.stderr


def test_readme_pool_example_is_valid_against_the_chart_crd():
    import re

    import jsonschema
    import yaml

    readme = (CHART / "README.md").read_text()
    (block,) = re.findall(r"apply -f - <<'EOF'\n(.*?)\nEOF\n", readme, re.S)
    pool = yaml.safe_load(block)
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    assert pool["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    assert pool["kind"] == crd["spec"]["names"]["kind"]
    schema = version["schema"]["openAPIV3Schema"]
    jsonschema.validate(pool, schema)
    declared = schema["properties"]["spec"]["properties"]
    assert set(pool["spec"]) <= set(declared)
    assert set(pool["spec"]["sidecar"]) <= set(declared["sidecar"]["properties"])
    # The operator translates the example (with a Llama-3.1-8B config.json from its test fixtures).
    from chart_support import REPO
    from kv_offload_operator.translate import translate

    model_config = json.loads((REPO / "tests" / "operator" / "fixtures" / "llama-3.1-8b.json").read_text())
    config = translate(pool["spec"]["vllmArgs"], model_config)
    assert config.model.name == "meta-llama/Llama-3.1-8B-Instruct" and len(config.fingerprint) == 16
