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


# alert -> (input series, [(eval time, [expected labels of each firing alert])])
CASES: dict[str, tuple[list[dict[str, str]], list[tuple[str, list[dict[str, str]]]]]] = {
    "KVOffloadHandshakeRejected": (
        [{"series": f'kv_offload_handshakes_total{{{target("llama-0")}, result="rejected", '
                    f'reason="fingerprint_mismatch"}}', "values": "0x10 1x20"},
         {"series": f'kv_offload_handshakes_total{{{target("llama-0")}, result="accepted", reason="ok"}}',
          "values": "0+5x30"},
         {"series": f'kv_offload_handshakes_total{{{target("mistral-0", "mistral")}, result="rejected", '
                    f'reason="bad_proof"}}', "values": "0x30"},
         {"series": f'kv_offload_handshakes_total{{{target("x-0", job="other")}, result="rejected", '
                    f'reason="bad_proof"}}', "values": "0+1x30"}],
        [("5m", []),
         ("15m", [pool_labels(reason="fingerprint_mismatch", severity="warning")]),
         ("25m", [])]),
    "KVOffloadIntegrityFailures": (
        [{"series": f'kv_offload_integrity_failures_total{{{target("llama-0")}}}', "values": "0x10 2x20"},
         {"series": f'kv_offload_integrity_failures_total{{{target("llama-1")}}}', "values": "0x30"}],
        [("5m", []), ("12m", [pool_labels(pod="llama-0", severity="critical")])]),
    "KVOffloadPoolMixedFingerprints": (
        [{"series": f'kv_offload_config_info{{{target(pod)}, fingerprint="{fp}", transport="ucx"}}',
          "values": "1x60"}
         for pod, fp in (("llama-0", "aaaaaaaaaaaaaaaa"), ("llama-1", "bbbbbbbbbbbbbbbb"))] +
        [{"series": f'kv_offload_config_info{{{target(pod, "mistral")}, fingerprint="cccccccccccccccc", '
                    f'transport="ucx"}}', "values": "1x60"}
         for pod in ("mistral-0", "mistral-1")],
        [("20m", []),  # a rollout may run two fingerprints for a while
         ("40m", [pool_labels(severity="warning")])]),
    "KVOffloadSidecarDown": (
        [{"series": f'up{{{target("llama-0")}}}', "values": "1x5 0x20"},
         {"series": f'up{{{target("llama-1")}}}', "values": "1x25"},
         {"series": f'up{{{target("x-0", job="other")}}}', "values": "0x25"}],
        [("8m", []),
         ("13m", [{"job": SIDECARS, "namespace": "inference", "pod": "llama-0", "kv_offload_io_pool": "llama",
                   "instance": "llama-0:5710", "severity": "warning"}])]),
    "KVOffloadPeerHitRatioDropped": (
        # llama: 60% peer hits for 90 minutes, then 10%. mistral: 60% throughout. cold: 3%, then 0%.
        [{"series": f'kv_offload_chunk_lookups_total{{{target("llama-0")}, result="peer_hit"}}',
          "values": "0+6x90 541+1x59"},
         {"series": f'kv_offload_chunk_lookups_total{{{target("llama-0")}, result="miss"}}',
          "values": "0+4x90 369+9x59"},
         {"series": f'kv_offload_chunk_lookups_total{{{target("mistral-0", "mistral")}, result="peer_hit"}}',
          "values": "0+6x150"},
         {"series": f'kv_offload_chunk_lookups_total{{{target("mistral-0", "mistral")}, result="miss"}}',
          "values": "0+4x150"},
         {"series": f'kv_offload_chunk_lookups_total{{{target("cold-0", "cold")}, result="peer_hit"}}',
          "values": "0+3x90 270x59"},
         {"series": f'kv_offload_chunk_lookups_total{{{target("cold-0", "cold")}, result="miss"}}',
          "values": "0+97x90 8827+100x59"}],
        [("80m", []), ("100m", []), ("135m", [pool_labels(severity="warning")])]),
    "KVOffloadPeerFetchTimeouts": (
        [{"series": f'kv_offload_peer_fetches_total{{{target("llama-0")}, result="ok"}}', "values": "0+10x60"},
         {"series": f'kv_offload_peer_fetches_total{{{target("llama-0")}, result="timeout"}}',
          "values": "0x20 1+2x39"},
         {"series": f'kv_offload_peer_fetches_total{{{target("mistral-0", "mistral")}, result="ok"}}',
          "values": "0+100x60"},
         {"series": f'kv_offload_peer_fetches_total{{{target("mistral-0", "mistral")}, result="timeout"}}',
          "values": "0+1x60"}],
        [("15m", []), ("27m", []), ("45m", [pool_labels(severity="warning")])]),
    "KVOffloadWebhookDown": (
        [{"series": f'up{{{operator_target("kvo-kv-offload-a")}}}', "values": "1x5 0x20"},
         {"series": f'up{{{operator_target("kvo-kv-offload-b")}}}', "values": "1x3 0x22"}],
        [("5m", []), ("7m", []), ("10m", [{"severity": "critical"}])]),
    "KVOffloadWebhookNotRedundant": (
        [{"series": f'up{{{operator_target("kvo-kv-offload-a")}}}', "values": "1x40"},
         {"series": f'up{{{operator_target("kvo-kv-offload-b")}}}', "values": "1x5 0x35"}],
        [("15m", []), ("25m", [{"severity": "warning"}])]),
    "KVOffloadWebhookDenials": (
        [{"series": f'kv_offload_operator_admissions_total{{{operator_target("kvo-kv-offload-a")}, '
                    f'result="denied", reason="pool_invalid"}}', "values": "0x10 3x20"},
         {"series": f'kv_offload_operator_admissions_total{{{operator_target("kvo-kv-offload-a")}, '
                    f'result="allowed", reason="injected"}}', "values": "0+5x30"}],
        [("5m", []), ("12m", [{"reason": "pool_invalid", "severity": "warning"}])]),
    "KVOffloadWebhookErrors": (
        [{"series": f'kv_offload_operator_webhook_errors_total{{{operator_target("kvo-kv-offload-a")}, '
                    f'reason="api_error"}}', "values": "0x10 1x20"},
         {"series": f'kv_offload_operator_webhook_errors_total{{{operator_target("kvo-kv-offload-a")}, '
                    f'reason="internal_error"}}', "values": "0x30"}],
        [("5m", []), ("12m", [{"reason": "api_error", "severity": "critical"}]), ("20m", [])]),
}
# The alert whose expected annotations are spelled out (the others compare labels only).
WITH_ANNOTATIONS = {"KVOffloadWebhookErrors": {
    "summary": "The kv-offload webhook could not decide on pods (api_error).",
    "description": "api_error: the operator could not read the pool (RBAC, API server); internal_error: an "
                   "exception, in the operator's log. Those pods were refused."}}


@pytest.fixture(scope="module")
def rule_groups(render) -> list[dict[str, Any]]:
    return find(render(RULES_VALUES), "PrometheusRule")["spec"]["groups"]


def promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool_path("promtool"), *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


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
    series, evaluations = CASES[alert]
    rules = write_rules(tmp_path, rule_groups, keep_annotations=set(WITH_ANNOTATIONS))
    annotations = WITH_ANNOTATIONS.get(alert)
    tests = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": at, "alertname": alert,
             "exp_alerts": [{"exp_labels": labels, **({"exp_annotations": annotations} if annotations else {})}
                            for labels in firing]}
            for at, firing in evaluations],
    }]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = promtool(tmp_path, "test", "rules", "tests.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_fails_when_an_expected_alert_does_not_fire(rule_groups, tmp_path):
    """The harness itself can fail: the integrity alert with no failure in its series."""
    rules = write_rules(tmp_path, rule_groups)
    tests = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f'kv_offload_integrity_failures_total{{{target("llama-0")}}}',
                          "values": "0x30"}],
        "alert_rule_test": [{"eval_time": "12m", "alertname": "KVOffloadIntegrityFailures",
                             "exp_alerts": [{"exp_labels": pool_labels(pod="llama-0", severity="critical")}]}],
    }]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = promtool(tmp_path, "test", "rules", "tests.yaml")
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
