"""The chart and the operator agree: flags, webhook path, port names, defaults."""

from __future__ import annotations

import argparse
import logging
import urllib.parse

import kopf
import pytest
import yaml
from chart_support import CHART, find
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.pools import pool_objects, pool_spec
from kv_offload_operator.webhook import pod_patch


def test_operator_deployment_arguments_parse_with_the_operator_cli(render):
    for values in ({}, {"operator": {"watchNamespace": "inference"}}):
        (container,) = find(render(values), "Deployment")["spec"]["template"]["spec"]["containers"]
        command, *flags = container["args"]
        assert command == "operator"
        parser = argparse.ArgumentParser(exit_on_error=False)
        operator_main.add_arguments(parser)
        args = parser.parse_args(flags)
        assert args.webhook_port == 9443 and args.health_port == 8080
        assert args.ready_peers_check_seconds == 15  # operator.readyPeersCheckSeconds
        assert args.webhook_cert_dir == "/etc/kv-offload/webhook-tls"
        assert args.clusterwide is not bool(values) and args.namespace == (
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
    spec = pool_spec.SidecarSpec.from_pool({"spec": {"sidecar": {"transport": "tcp"}}},
                                           default_image="kv-offload:test")
    container = pod_patch.sidecar_container(pool_name="demo", namespace="inference", sidecar=spec,
                                            dp_indices=dp_indices, shm_volume=pod_patch.SHM_VOLUME)
    wanted = {p["containerPort"] for p in container["ports"]}
    policy = find(render({"networkPolicy": {"enabled": True, "openAllPortsBetweenPoolPods": False,
                                             "pools": [{"name": "demo", "namespace": "inference"}]}}),
                  "NetworkPolicy")
    peer_rule = policy["spec"]["ingress"][0]
    admitted = set()
    for port in peer_rule["ports"]:
        admitted |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    assert wanted <= admitted


@pytest.mark.parametrize("dp_indices", [(0,), (2, 3), (5,), (4, 5, 6, 7)])
def test_pod_monitor_scrapes_one_control_port_of_every_pod_whatever_its_dp_start_rank(render, dp_indices):
    spec = pool_spec.SidecarSpec.from_pool({"spec": {}}, default_image="kv-offload:test")
    container = pod_patch.sidecar_container(pool_name="demo", namespace="inference", sidecar=spec,
                                            dp_indices=dp_indices, shm_volume=pod_patch.SHM_VOLUME)
    monitor = find(render({"monitoring": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (scraped,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    assert scraped["containerPort"] == spec.base_port + dp_indices[0]  # a control port, serving /metrics


@pytest.mark.parametrize("dp_indices", [(0,), (2, 3), (7,)])
def test_network_policy_lets_the_operator_read_every_pods_kvo_metrics_port_for_ready_peers(render, dp_indices):
    spec = pool_spec.SidecarSpec.from_pool({"spec": {}}, default_image="kv-offload:test")
    container = pod_patch.sidecar_container(pool_name="demo", namespace="inference", sidecar=spec,
                                            dp_indices=dp_indices, shm_volume=pod_patch.SHM_VOLUME)
    (metrics,) = [p for p in container["ports"] if p["name"] == pod_patch.METRICS_PORT_NAME]
    objects = render({"networkPolicy": {"enabled": True, "pools": [{"name": "demo", "namespace": "inference"}]}})
    operator_labels = find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    policy = find(objects, "NetworkPolicy")
    admitted = set()
    for rule in policy["spec"]["ingress"]:
        selects_operator = any(
            peer.get("podSelector", {}).get("matchLabels", {}).items() <= operator_labels.items()
            and "podSelector" in peer and "namespaceSelector" in peer for peer in rule.get("from", []))
        if selects_operator:
            for port in rule["ports"]:
                admitted |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    assert metrics["containerPort"] in admitted


def test_readme_states_the_hash_seed_and_the_ucx_settings_the_webhook_injects():
    readme = " ".join((CHART / "README.md").read_text().split())
    assert "spec.hashSeed" in readme and "PYTHONHASHSEED" in readme and "spec.sidecar.env" in readme
    # Unset by default: the secret seed, read by secretKeyRef from the pool Secret.
    assert f"`{pool_objects.HASH_SEED_KEY}`" in readme and "secretKeyRef" in readme
    for name, value in pod_patch.UCX_SIDECAR_ENV.items():
        assert f"{name}={value}" in readme
    assert pod_patch.METRICS_PORT_NAME in readme


def test_pod_monitor_default_port_is_the_webhooks_metrics_port_name():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["monitoring"]["podMonitor"]["portName"] == pod_patch.METRICS_PORT_NAME



def _readme_section(title: str) -> str:
    readme = (CHART / "README.md").read_text()
    return " ".join(readme.split(f"## {title}", 1)[1].split("\n## ", 1)[0].split())


def test_readme_troubleshooting_quotes_the_messages_the_code_prints():
    from kv_offload_operator.translation.translate import TranslationError, translate
    from kv_offload_sidecar.data import tls
    from kv_offload_sidecar.engine.sidecar_match import refusal_message

    section = _readme_section("Troubleshooting")
    with pytest.raises(TranslationError) as translation:
        translate(["vllm", "serve", "meta-llama/Llama-3.1-8B", "--block-size", "16"], {})
    assert " ".join(str(translation.value).split()) in section
    refusal = refusal_message(("10.42.1.17", 5710), ["tokens_per_hash: 16 != 32", "hash_seed: '1234' != '3141592'"])
    assert refusal in section
    (purpose_hint,) = [hint for word, hint in tls._REFUSAL_HINTS if word == "purpose"]
    assert f"(unsuitable certificate purpose): {purpose_hint}" in section
    for line in _rejection_lines():
        assert line in section
    assert "is Invalid (...); fix the pool's spec before creating its pods." in section
    assert "does not exist in namespace 'inference': create it, or fix the pod's label kv-offload.io/pool." in section


def _rejection_lines() -> list[str]:
    """What a sidecar logs of twelve handshakes of one key holder with another fingerprint in a
    minute (the rejection log and the detail control/app.py gives it)."""
    from kv_offload_sidecar.control.app import PROVEN_DETAIL_CHARS
    from kv_offload_sidecar.peers.handshake import HandshakeError
    from kv_offload_sidecar.rejections import RejectionLog

    lines: list[str] = []
    logger = logging.getLogger("kv_offload_sidecar.sidecar")
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(  # type: ignore[method-assign]
        f"{record.levelname} {record.name}: {record.getMessage()}")
    logger.addHandler(handler)
    now = [0.0]
    try:
        rejections = RejectionLog(logger, clock=lambda: now[0])
        exc = HandshakeError("fingerprint_mismatch", "handshake rejected (fingerprint_mismatch): fields "
                             "differ: fingerprint, tokens_per_hash",
                             ["fingerprint: 729e100e1a30795b != f95e1013d165f5c8", "tokens_per_hash: 16 != 32"])
        for _ in range(12):
            rejections.reject("10.42.1.17", f"handshake {exc.reason}", "; ".join([str(exc), *exc.diff]),
                              detail_chars=PROVEN_DETAIL_CHARS)
        now[0] = 60.0
        rejections.flush()
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 2, lines
    return lines


def test_readme_says_which_pods_wait_while_no_replica_answers_and_how_to_recover(render):
    section = _readme_section("Operator replicas and the webhook")
    (hook,) = find(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert hook["objectSelector"]["matchExpressions"][0]["key"] in section  # only labelled pods wait
    assert "`objectSelector`" in section and "FailedCreate" in section
    assert "webhook.failurePolicy=Ignore" in section and "--replicas=2" in section
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f"`operator.peering.lifetimeSeconds` ({values['operator']['peering']['lifetimeSeconds']})" in section
