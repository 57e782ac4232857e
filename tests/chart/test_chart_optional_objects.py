"""Monitoring, dashboard, NetworkPolicy, NOTES and the `helm test` pod."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from chart_support import CHART, FULLNAME, NAMESPACE, WEBHOOK_DNS, find, kinds


def test_pod_monitor_scrapes_every_pool_pod_and_keeps_the_pool_label(render):
    objects = render({"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}})
    monitor = find(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"] == {"matchExpressions": [{"key": "kv-offload.io/pool",
                                                                  "operator": "Exists"}]}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podTargetLabels"] == ["kv-offload.io/pool"]
    # One job label for every sidecar target: the alerts select it.
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "kvo-metrics", "path": "/metrics", "interval": "30s",
                                                       "relabelings": [{"targetLabel": "job",
                                                                        "replacement": f"{FULLNAME}-sidecars"}]}]
    assert "PodMonitor" not in kinds(render())


def test_service_monitor_scrapes_the_operators_metrics_port(render):
    objects = render({"monitoring": {"serviceMonitor": {"enabled": True}}})
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    (served,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert f"--metrics-port={served['containerPort']}" in container["args"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": f"{FULLNAME}-operator"}]


def test_prometheus_rule_has_each_monitors_alerts_only_with_that_monitor(render, render_error):
    both = find(render({"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True},
                                       "prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}),
                "PrometheusRule")
    assert both["metadata"]["labels"]["release"] == "kps"
    groups = {g["name"]: g for g in both["spec"]["groups"]}
    assert set(groups) == {"kv-offload.sidecars", "kv-offload.operator"}
    alerts = {g: {r["alert"] for r in groups[g]["rules"] if "alert" in r} for g in groups}
    assert alerts["kv-offload.sidecars"] == {
        "KVOffloadHandshakeRejected", "KVOffloadPeerOutsidePool", "KVOffloadIntegrityFailures",
        "KVOffloadPoolMixedFingerprints", "KVOffloadPoolMixedModelIdentities", "KVOffloadSidecarDown",
        "KVOffloadPeerHitRatioDropped", "KVOffloadPeerFetchTimeouts"}
    assert alerts["kv-offload.operator"] == {"KVOffloadWebhookDown", "KVOffloadWebhookNotRedundant",
                                             "KVOffloadWebhookDenials", "KVOffloadWebhookErrors"}
    for group, job in (("kv-offload.sidecars", f"{FULLNAME}-sidecars"),
                       ("kv-offload.operator", f"{FULLNAME}-operator")):
        for rule in groups[group]["rules"]:
            assert f'job="{job}"' in rule["expr"] or rule.get("alert") == "KVOffloadPeerHitRatioDropped", rule
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"warning", "critical"}
                assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    sidecars_only = find(render({"monitoring": {"podMonitor": {"enabled": True},
                                                "prometheusRule": {"enabled": True}}}), "PrometheusRule")
    assert [g["name"] for g in sidecars_only["spec"]["groups"]] == ["kv-offload.sidecars"]
    assert "PrometheusRule" not in kinds(render({"monitoring": {"podMonitor": {"enabled": True}}}))
    assert "neither monitoring.podMonitor nor monitoring.serviceMonitor" in render_error(
        {"monitoring": {"prometheusRule": {"enabled": True}}})


def test_dashboard_config_map_carries_the_chart_dashboard_file(render):
    objects = render({"grafana": {"dashboards": {"enabled": True, "namespace": "monitoring"}}})
    config_map = find(objects, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    shipped = json.loads((CHART / "dashboards" / "kv-offload.json").read_text())
    assert json.loads(config_map["data"]["kv-offload.json"]) == shipped
    assert "ConfigMap" not in kinds(render())


def test_network_policy_opens_sidecar_ports_to_the_same_pools_pods_only_and_metrics_to_monitoring(render):
    objects = render({"networkPolicy": {"enabled": True, "openAllPortsBetweenPoolPods": False, "pools": [
        {"name": "llama", "namespace": "a"}, {"name": "mistral", "namespace": "a"}, {"name": "llama"}]}})
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p
                for p in objects if p["kind"] == "NetworkPolicy"}
    operator_selector = find(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert sorted(policies) == [("a", "kvo-kv-offload-pool-llama"), ("a", "kvo-kv-offload-pool-mistral"),
                                (NAMESPACE, "kvo-kv-offload-pool-llama")]
    for (_, name), policy in policies.items():
        pool = name.rsplit("-", 1)[1]
        same_pool = {"matchLabels": {"kv-offload.io/pool": pool}}
        spec = policy["spec"]
        assert spec["podSelector"] == same_pool and spec["policyTypes"] == ["Ingress"]
        peers, monitoring, operator, serving = spec["ingress"]
        # Only pods of the same pool (same namespace: no namespaceSelector) reach the sidecar ports.
        assert peers["from"] == [{"podSelector": same_pool}]
        assert peers["ports"] == [{"protocol": "TCP", "port": 5710, "endPort": 5717},
                                  {"protocol": "TCP", "port": 5810}]
        assert monitoring["from"] == [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]
        assert monitoring["ports"] == [{"protocol": "TCP", "port": 5710, "endPort": 5717}]
        # The operator's pods (release namespace AND its selector labels) read /metrics for READY PEERS.
        assert operator["from"] == [{
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
            "podSelector": {"matchLabels": operator_selector}}]
        assert operator["ports"] == monitoring["ports"]
        assert serving == {"ports": [{"protocol": "TCP", "port": 8000}]}
        assert policy["metadata"]["labels"]["kv-offload.io/pool"] == pool
    # No rule admits "any pool pod": a pod of one pool never reaches another pool's sidecar.
    assert "Exists" not in json.dumps(list(policies.values()))
    # The default admits every port between the pods of one pool (UCX picks its own ports).
    default = find(render({"networkPolicy": {"enabled": True, "pools": [{"name": "llama"}]}}), "NetworkPolicy")
    assert default["metadata"]["namespace"] == NAMESPACE
    pool_pods = {"podSelector": {"matchLabels": {"kv-offload.io/pool": "llama"}}}
    assert default["spec"]["ingress"][0] == {"from": [pool_pods]}
    assert "NetworkPolicy" not in kinds(render())


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
    single = helm("install", "kvo", str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                  "--set", "operator.replicas=1")
    assert single.returncode == 0, single.stderr
    assert single.stdout.split("NOTES:", 1)[1].strip().startswith("WARNING: operator.replicas is 1")


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
