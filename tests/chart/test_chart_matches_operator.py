"""The chart and the operator agree: flags, webhook path, port names, defaults."""

from __future__ import annotations

import argparse
import urllib.parse

import kopf
import pytest
import yaml
from chart_support import CHART, find
from kv_offload_operator import main as operator_main
from kv_offload_operator import resources


def test_operator_deployment_arguments_parse_with_the_operator_cli(render):
    for values in ({}, {"operator": {"watchNamespace": "inference"}}):
        (container,) = find(render(values), "Deployment")["spec"]["template"]["spec"]["containers"]
        command, *flags = container["args"]
        assert command == "operator"
        parser = argparse.ArgumentParser(exit_on_error=False)
        operator_main.add_arguments(parser)
        args = parser.parse_args(flags)
        assert args.webhook_port == 9443 and args.health_port == 8080
        assert args.webhook_cert_dir == "/etc/kv-offload/webhook-tls"
        assert args.all_namespaces is not bool(values) and args.namespace == (
            ["inference"] if values else [])


def test_webhook_path_is_the_operator_mutating_handler_id(render):
    import kv_offload_operator.handlers  # noqa: F401 (registers the handlers)

    # kopf serves a webhook handler at "/<quoted handler id>" (kopf's own admission
    # server); its registry has no public listing, hence the private attribute.
    handlers = kopf.get_default_registry()._webhooks.get_all_handlers()
    mutating = [h.id for h in handlers if str(h.reason.value) == "mutating"]
    assert len(mutating) == 1
    (hook,) = find(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/" + urllib.parse.quote(mutating[0])


@pytest.mark.parametrize("dp_indices", [(0,), (0, 1, 2, 3), (6, 7)])
def test_network_policy_admits_every_port_the_webhook_gives_the_sidecar(render, dp_indices):
    spec = resources.SidecarSpec.from_pool({"spec": {"sidecar": {"transport": "tcp"}}},
                                           default_image="kv-offload:test")
    container = resources.sidecar_container(pool_name="demo", namespace="inference", sidecar=spec,
                                            dp_indices=dp_indices, shm_volume=resources.SHM_VOLUME)
    wanted = {p["containerPort"] for p in container["ports"]}
    policy = find(render({"networkPolicy": {"enabled": True, "openAllPortsBetweenPoolPods": False}}),
                  "NetworkPolicy")
    peer_rule = policy["spec"]["ingress"][0]
    admitted = set()
    for port in peer_rule["ports"]:
        admitted |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    assert wanted <= admitted


def test_pod_monitor_scrapes_a_port_the_webhook_names(render):
    spec = resources.SidecarSpec.from_pool({"spec": {}}, default_image="kv-offload:test")
    container = resources.sidecar_container(pool_name="demo", namespace="inference", sidecar=spec,
                                            dp_indices=(0,), shm_volume=resources.SHM_VOLUME)
    monitor = find(render({"monitoring": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}


def test_chart_port_defaults_are_the_operator_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["sidecar"]["controlPort"] == resources.DEFAULT_BASE_PORT
    assert values["sidecar"]["dataPort"] == resources.DEFAULT_DATA_PORT
