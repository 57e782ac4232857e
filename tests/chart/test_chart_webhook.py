"""The sidecar-injection webhook and its TLS: made by hook Jobs by default, cert-manager optional.

The Jobs' own behaviour against an API server is in test_webhook_certificate_lookup.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import CHART, FULLNAME, NAMESPACE, WEBHOOK_DNS, find, kinds
from kv_offload_operator.webhook.admission import READS_TIMEOUT_SECONDS


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


def test_the_webhooks_api_reads_give_up_well_before_the_api_server_gives_up_on_the_webhook(render):
    (hook,) = find(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert hook["timeoutSeconds"] >= 2 * READS_TIMEOUT_SECONDS


SECRET = f"{FULLNAME}-webhook-tls"
CERT_JOB = f"{FULLNAME}-webhook-cert"


def _args(job: dict[str, Any]) -> dict[str, list[str]]:
    """The Job container's ``--flag=value`` arguments as {flag: [values]}."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    found: dict[str, list[str]] = {}
    for arg in container["args"][2:]:
        flag, _, value = arg.partition("=")
        found.setdefault(flag, []).append(value)
    return found


def test_self_managed_mode_renders_no_key_material_only_the_hook_jobs_that_make_it(render):
    objects = render()
    assert "Secret" not in kinds(objects)  # made in the cluster by the create Job, never rendered
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert "caBundle" not in hook["clientConfig"]  # written by the patch Job; no render owns it
    create, patch = find(objects, "Job", f"{CERT_JOB}-create"), find(objects, "Job", f"{CERT_JOB}-patch")
    assert create["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert patch["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    for job, action in ((create, "create"), (patch, "patch")):
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["args"][:2] == ["webhook-cert", action]
        assert container["image"] == find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert job["spec"]["template"]["spec"]["serviceAccountName"] == CERT_JOB
        assert _args(job)["--secret"] == [SECRET] and _args(job)["--namespace"] == [NAMESPACE]
    # The certificate names every DNS name of the webhook Service; the operator mounts that Secret.
    assert WEBHOOK_DNS in _args(create)["--dns-name"]
    webhook = find(objects, "MutatingWebhookConfiguration")
    assert _args(patch)["--webhook-configuration"] == [webhook["metadata"]["name"]]
    volumes = find(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "webhook-tls")["secret"]["secretName"] == SECRET
    # The Jobs' account reaches only that Secret and that configuration (create cannot be limited to a name).
    role, cluster_role = find(objects, "Role", CERT_JOB), find(objects, "ClusterRole", CERT_JOB)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [SECRET], "verbs": ["get", "patch"]}]
    assert cluster_role["rules"] == [{"apiGroups": ["admissionregistration.k8s.io"],
                                      "resources": ["mutatingwebhookconfigurations"],
                                      "resourceNames": [FULLNAME], "verbs": ["get", "patch"]}]
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        notes = find(objects, kind, CERT_JOB)["metadata"]["annotations"]
        assert set(notes["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade", "post-install", "post-upgrade"}
        assert int(notes["helm.sh/hook-weight"]) < int(create["metadata"]["annotations"]["helm.sh/hook-weight"])


@pytest.mark.parametrize("values", [[], ["-f", "examples/all-features.yaml"], ["-f", "examples/monitoring.yaml"],
                                    ["--set", "webhook.certManager.enabled=true"]],
                         ids=["defaults", "all-features", "monitoring", "cert-manager"])
def test_every_render_is_byte_identical_so_gitops_tools_see_no_drift(helm, values):
    args = ["template", "kvo", str(CHART), "--namespace", NAMESPACE,
            *[str(CHART / v) if v.startswith("examples/") else v for v in values]]
    first, second = helm(*args), helm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert "BEGIN" not in first.stdout  # no PEM of any kind


def test_cert_manager_mode_issues_a_certificate_from_its_own_ca_and_injects_the_ca(render):
    objects = render({"webhook": {"certManager": {"enabled": True}}})
    assert f"{FULLNAME}-webhook-tls" not in {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert "Job" not in kinds(objects)  # no certificate Jobs: cert-manager writes the Secret and the caBundle
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
