"""The chart's PrometheusRule, evaluated by Prometheus' own rule engine (`promtool test rules`).

For every alert: series that must fire it (with the labels it must carry) and
series that must not (other pools, other jobs, healthy values, too short a
while). The series carry the labels the chart's monitors give the scraped
targets: the job label they set, namespace and pod, and the pool label the
PodMonitor copies from the pod (kv_offload_io_pool). Annotations are left out
of the comparisons except for one alert that spells them out; `promtool
check rules` parses every one of them.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import FULLNAME, NAMESPACE, find, tool_path

RULES_VALUES = {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True},
                               "prometheusRule": {"enabled": True}}}
SIDECARS = f"{FULLNAME}-sidecars"
OPERATOR = f"{FULLNAME}-operator"


def target(pod: str, pool: str = "llama", namespace: str = "inference", job: str = SIDECARS) -> str:
    """The labels of one sidecar target, as PromQL label pairs."""
    return (f'job="{job}", namespace="{namespace}", pod="{pod}", kv_offload_io_pool="{pool}", '
            f'instance="{pod}:5710"')


def operator_target(pod: str) -> str:
    return f'job="{OPERATOR}", namespace="{NAMESPACE}", pod="{pod}", instance="{pod}:8081"'


def pool_labels(pool: str = "llama", **more: str) -> dict[str, str]:
    return {"namespace": "inference", "kv_offload_io_pool": pool, **more}


def series(metric: str, labels: str, values: str) -> dict[str, str]:
    """One input series of a promtool test: ``metric{labels}`` and its values in promtool's
    expanding notation (``0+5x30``: 0, then 30 steps of +5)."""
    return {"series": f"{metric}{{{labels}}}", "values": values}


HANDSHAKES = "kv_offload_handshakes_total"
INTEGRITY_FAILURES = "kv_offload_integrity_failures_total"
LOOKUPS = "kv_offload_chunk_lookups_total"
FETCHES = "kv_offload_peer_fetches_total"
ADMISSIONS = "kv_offload_operator_admissions_total"
WEBHOOK_ERRORS = "kv_offload_operator_webhook_errors_total"
CONFIG_INFO = "kv_offload_config_info"

# alert -> (input series, [(eval time, [expected labels of each firing alert])])
CASES: dict[str, tuple[list[dict[str, str]], list[tuple[str, list[dict[str, str]]]]]] = {
    "KVOffloadHandshakeRejected": (
        [series(HANDSHAKES, f'{target("llama-0")}, result="rejected", reason="fingerprint_mismatch"',
                "0x10 1x20"),
         series(HANDSHAKES, f'{target("llama-0")}, result="accepted", reason="ok"', "0+5x30"),
         series(HANDSHAKES, f'{target("mistral-0", "mistral")}, result="rejected", reason="bad_proof"', "0x30"),
         series(HANDSHAKES, f'{target("x-0", job="other")}, result="rejected", reason="bad_proof"', "0+1x30"),
         series(HANDSHAKES, f'{target("qwen-0", "qwen")}, result="rejected", reason="other_pool"', "0+1x30")],
        [("5m", []),
         ("15m", [pool_labels(reason="fingerprint_mismatch", severity="warning")]),
         ("25m", [])]),
    "KVOffloadPeerOutsidePool": (
        [series(HANDSHAKES, f'{target("llama-0")}, result="rejected", reason="other_pool"', "0+1x60"),
         series(HANDSHAKES, f'{target("qwen-0", "qwen")}, result="rejected", reason="other_pool"', "0+1x10 10x50"),
         series(HANDSHAKES, f'{target("mistral-0", "mistral")}, result="rejected", reason="bad_proof"', "0+1x60")],
        [("20m", []), ("45m", [pool_labels(severity="warning")])]),
    "KVOffloadIntegrityFailures": (
        [series(INTEGRITY_FAILURES, target("llama-0"), "0x10 2x20"),
         series(INTEGRITY_FAILURES, target("llama-1"), "0x30")],
        [("5m", []), ("12m", [pool_labels(pod="llama-0", severity="critical")])]),
    "KVOffloadPoolMixedFingerprints": (
        [series(CONFIG_INFO, f'{target(pod, pool)}, fingerprint="{fp}", transport="ucx"', "1x60")
         for pod, pool, fp in (("llama-0", "llama", "aaaaaaaaaaaaaaaa"), ("llama-1", "llama", "bbbbbbbbbbbbbbbb"),
                               ("mistral-0", "mistral", "cccccccccccccccc"),
                               ("mistral-1", "mistral", "cccccccccccccccc"))],
        [("20m", []),  # a rollout may run two fingerprints for a while
         ("40m", [pool_labels(severity="warning")])]),
    "KVOffloadPoolMixedModelIdentities": (
        [series(CONFIG_INFO, f'{target(pod, pool)}, fingerprint="{"a" * 16}", transport="ucx", '
                f'model_identity="{identity}"', "1x60")
         for pod, pool, identity in (("llama-0", "llama", "0a" * 8), ("llama-1", "llama", "0b" * 8),
                                     ("llama-2", "llama", ""),  # its engine has not attached yet
                                     ("mistral-0", "mistral", "0c" * 8),
                                     ("mistral-1", "mistral", ""))],  # one identity and a pod loading
        [("20m", []),  # a rollout to other weights may run two identities for a while
         ("40m", [pool_labels(severity="warning")])]),
    "KVOffloadSidecarDown": (
        [series("up", target("llama-0"), "1x5 0x20"),
         series("up", target("llama-1"), "1x25"),
         series("up", target("x-0", job="other"), "0x25")],
        [("8m", []),
         ("13m", [{"job": SIDECARS, "namespace": "inference", "pod": "llama-0", "kv_offload_io_pool": "llama",
                   "instance": "llama-0:5710", "severity": "warning"}])]),
    "KVOffloadPeerHitRatioDropped": (
        # llama: 60% peer hits for 90 minutes, then 10%. mistral: 60% throughout. cold: 3%, then 0%.
        [series(LOOKUPS, f'{target(pod, pool)}, result="{result}"', values)
         for pod, pool, result, values in (
             ("llama-0", "llama", "peer_hit", "0+6x90 541+1x59"), ("llama-0", "llama", "miss", "0+4x90 369+9x59"),
             ("mistral-0", "mistral", "peer_hit", "0+6x150"), ("mistral-0", "mistral", "miss", "0+4x150"),
             ("cold-0", "cold", "peer_hit", "0+3x90 270x59"), ("cold-0", "cold", "miss", "0+97x90 8827+100x59"))],
        [("80m", []), ("100m", []), ("135m", [pool_labels(severity="warning")])]),
    "KVOffloadPeerFetchTimeouts": (
        [series(FETCHES, f'{target(pod, pool)}, result="{result}"', values)
         for pod, pool, result, values in (
             ("llama-0", "llama", "ok", "0+10x60"), ("llama-0", "llama", "timeout", "0x20 1+2x39"),
             ("mistral-0", "mistral", "ok", "0+100x60"), ("mistral-0", "mistral", "timeout", "0+1x60"))],
        [("15m", []), ("27m", []), ("45m", [pool_labels(severity="warning")])]),
    "KVOffloadWebhookDown": (
        [series("up", operator_target("kvo-kv-offload-a"), "1x5 0x20"),
         series("up", operator_target("kvo-kv-offload-b"), "1x3 0x22")],
        [("5m", []), ("7m", []), ("10m", [{"severity": "critical"}])]),
    "KVOffloadWebhookNotRedundant": (
        [series("up", operator_target("kvo-kv-offload-a"), "1x40"),
         series("up", operator_target("kvo-kv-offload-b"), "1x5 0x35")],
        [("15m", []), ("25m", [{"severity": "warning"}])]),
    "KVOffloadWebhookDenials": (
        [series(ADMISSIONS, f'{operator_target("kvo-kv-offload-a")}, result="denied", reason="pool_invalid"',
                "0x10 3x20"),
         series(ADMISSIONS, f'{operator_target("kvo-kv-offload-a")}, result="allowed", reason="injected"',
                "0+5x30")],
        [("5m", []), ("12m", [{"reason": "pool_invalid", "severity": "warning"}])]),
    "KVOffloadWebhookErrors": (
        [series(WEBHOOK_ERRORS, f'{operator_target("kvo-kv-offload-a")}, reason="api_error"', "0x10 1x20"),
         series(WEBHOOK_ERRORS, f'{operator_target("kvo-kv-offload-a")}, reason="internal_error"', "0x30")],
        [("5m", []), ("12m", [{"reason": "api_error", "severity": "critical"}]), ("20m", [])]),
}
# The alert whose expected annotations are spelled out (the others compare labels only).
WITH_ANNOTATIONS = {"KVOffloadWebhookErrors": {
    "summary": "The kv-offload webhook could not decide on pods (api_error).",
    "description": "api_error: the operator could not read the pool (RBAC, API server); api_timeout: the API "
                   "server answered the admission's reads too slowly (the pods are retried); internal_error: an "
                   "exception, in the operator's log. Those pods were refused."}}


@pytest.fixture(scope="module")
def rule_groups(render) -> list[dict[str, Any]]:
    return find(render(RULES_VALUES), "PrometheusRule")["spec"]["groups"]


def promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool_path("promtool"), *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


def promtool_test(tmp_path: Path, rules: Path, input_series: list[dict[str, str]],
                  alert_rule_test: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of one test over the rule file ``rules``, series sampled every minute."""
    tests = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": input_series, "alert_rule_test": alert_rule_test}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    return promtool(tmp_path, "test", "rules", "tests.yaml")


def write_rules(tmp_path: Path, groups: list[dict[str, Any]], keep_annotations: set[str] = frozenset()) -> Path:
    groups = copy.deepcopy(groups)
    for group in groups:
        for rule in group["rules"]:
            if "alert" in rule and rule["alert"] not in keep_annotations:
                rule.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_promtool_accepts_every_rule_and_annotation_template(rule_groups, tmp_path):
    rules = write_rules(tmp_path, rule_groups, keep_annotations={r["alert"] for g in rule_groups
                                                                 for r in g["rules"] if "alert" in r})
    result = promtool(tmp_path, "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups)} rules found" in result.stdout


def test_every_alert_of_the_chart_has_a_case_here(rule_groups):
    assert {r["alert"] for g in rule_groups for r in g["rules"] if "alert" in r} == set(CASES)


@pytest.mark.parametrize("alert", sorted(CASES))
def test_alert_fires_for_its_series_and_not_for_the_others(rule_groups, tmp_path, alert):
    inputs, evaluations = CASES[alert]
    rules = write_rules(tmp_path, rule_groups, keep_annotations=set(WITH_ANNOTATIONS))
    annotations = WITH_ANNOTATIONS.get(alert)
    result = promtool_test(tmp_path, rules, inputs, [
        {"eval_time": at, "alertname": alert,
         "exp_alerts": [{"exp_labels": labels, **({"exp_annotations": annotations} if annotations else {})}
                        for labels in firing]}
        for at, firing in evaluations])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_fails_when_an_expected_alert_does_not_fire(rule_groups, tmp_path):
    """The harness itself can fail: the integrity alert with no failure in its series."""
    rules = write_rules(tmp_path, rule_groups)
    result = promtool_test(
        tmp_path, rules, [series(INTEGRITY_FAILURES, target("llama-0"), "0x30")],
        [{"eval_time": "12m", "alertname": "KVOffloadIntegrityFailures",
          "exp_alerts": [{"exp_labels": pool_labels(pod="llama-0", severity="critical")}]}])
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
