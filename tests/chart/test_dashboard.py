"""The Grafana dashboard: hit rate first, PromQL that Prometheus parses, only real metric names."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from chart_support import tool_path
from dashboard_support import (
    dashboard_expressions,
    fill_variables,
    load_dashboard,
    metric_names,
    panels_in_reading_order,
)
from kv_offload_sidecar.metrics import CONFIG_INFO_LABELS, SidecarMetrics, exported_metric_names
from prometheus_client import CollectorRegistry

# Series Prometheus itself writes for every scrape target (the sidecars do not export them).
PROMETHEUS_SERIES = {"up"}
# Labels the scrape adds to every sidecar series (its pod's target labels).
TARGET_LABELS = {"pod", "namespace", "kv_offload_io_pool"}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names a fresh sidecar registry exposes (the source of truth for the dashboard)."""
    registry = CollectorRegistry()
    SidecarMetrics(registry)
    names = exported_metric_names(registry)
    assert "kv_offload_chunk_lookups_total" in names
    return names


def promtool_check(expressions: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`promtool check rules` over one recording rule per expression: Prometheus' own parser."""
    rules = {"groups": [{"name": "kv-offload-dashboard", "rules": [
        {"record": f"kv_offload_dashboard:expr_{i}", "expr": expr}
        for i, expr in enumerate(expressions)]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([tool_path("promtool"), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_first_panel_is_the_hit_ratio_split_local_peer_miss():
    first = panels_in_reading_order(load_dashboard())[0]
    assert first["gridPos"]["y"] == 0 and first["gridPos"]["x"] == 0
    assert "hit ratio" in first["title"].lower()
    assert [t["legendFormat"] for t in first["targets"]] == ["local", "peer", "miss"]
    for target, result in zip(first["targets"], ("local_hit", "peer_hit", "miss")):
        assert f'result="{result}"' in target["expr"]
        assert metric_names(target["expr"]) == {"kv_offload_chunk_lookups_total"}
    assert first["fieldConfig"]["defaults"]["unit"] == "percentunit"


@pytest.mark.parametrize("title_words, metric", [
    ("peer bytes", "kv_offload_peer_bytes_total"),
    ("fetch latency", "kv_offload_peer_fetch_duration_seconds_bucket"),
    ("handshake rejections", "kv_offload_handshakes_total"),
    ("peers by state", "kv_offload_peers"),
    ("store usage", "kv_offload_store_used_bytes"),
    ("evictions", "kv_offload_evictions_total"),
    ("integrity failures", "kv_offload_integrity_failures_total"),
    ("hit ratio per pod", "kv_offload_chunk_lookups_total"),
    ("fingerprint per pod", "kv_offload_config_info"),
    ("sidecars up", "up"),
])
def test_dashboard_has_a_panel_for(title_words, metric):
    panels = [p for p in load_dashboard()["panels"] if title_words in p["title"].lower()]
    assert len(panels) == 1, f"no single panel titled like {title_words!r}"
    used = set().union(*(metric_names(t["expr"]) for t in panels[0]["targets"]))
    assert metric in used


def test_fetch_latency_panel_shows_p50_and_p99():
    (panel,) = [p for p in load_dashboard()["panels"] if "latency" in p["title"].lower()]
    exprs = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    assert exprs["p50"].startswith("histogram_quantile(0.5,")
    assert exprs["p99"].startswith("histogram_quantile(0.99,")


def test_handshake_panel_shows_only_rejections_by_reason():
    (panel,) = [p for p in load_dashboard()["panels"] if "handshake" in p["title"].lower()]
    (target,) = panel["targets"]
    assert 'result="rejected"' in target["expr"] and "by (reason)" in target["expr"]


def test_panels_have_unique_ids_and_do_not_overlap():
    panels = load_dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area


def test_every_dashboard_expression_parses_with_promtool(tmp_path):
    expressions = [fill_variables(expr) for _, expr in dashboard_expressions(load_dashboard())]
    assert len(expressions) >= 12
    result = promtool_check(expressions, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def test_promtool_check_rejects_a_broken_expression(tmp_path):
    result = promtool_check(['sum(rate(kv_offload_chunk_lookups_total[5m])'], tmp_path)
    assert result.returncode != 0
    assert "parse error" in (result.stdout + result.stderr)


def test_dashboard_uses_only_metric_names_the_sidecar_exports(exported):
    for where, expr in dashboard_expressions(load_dashboard()):
        names = metric_names(fill_variables(expr))
        assert names, f"{where} selects no metric"
        unknown = names - exported - PROMETHEUS_SERIES
        assert not unknown, f"{where} uses {sorted(unknown)}, which the sidecar does not export"


def test_metric_name_check_catches_a_misspelled_metric(exported):
    expr = ('sum by (result) (rate(kv_offload_chunk_lookup_total{result="miss"}[5m]))'
            ' / ignoring (result) group_left sum(rate(kv_offload_chunk_lookups_total[5m]))')
    assert metric_names(expr) == {"kv_offload_chunk_lookup_total", "kv_offload_chunk_lookups_total"}
    assert metric_names(expr) - exported == {"kv_offload_chunk_lookup_total"}


def test_unknown_grafana_variable_is_an_error():
    with pytest.raises(KeyError, match="cluster"):
        fill_variables('kv_offload_peers{cluster="$cluster"}')


def test_per_pod_panels_split_by_pod_and_sidecars_up_counts_scraped_targets():
    panels = {p["title"].lower(): p for p in load_dashboard()["panels"]}
    (per_pod,) = panels["chunk hit ratio per pod"]["targets"]
    assert per_pod["expr"].count("sum by (pod)") == 2 and per_pod["legendFormat"] == "{{pod}}"
    assert 'result=~"local_hit|peer_hit"' in per_pod["expr"]
    (fingerprints,) = panels["fingerprint per pod"]["targets"]
    assert fingerprints["expr"].startswith("max by (pod, fingerprint") and fingerprints["format"] == "table"
    up = {t["legendFormat"]: t["expr"] for t in panels["sidecars up"]["targets"]}
    assert up["up"].startswith("sum(up{") and up["scraped"].startswith("count(up{")


def test_the_fingerprint_table_shows_only_the_labels_config_info_carries():
    (panel,) = [p for p in load_dashboard()["panels"] if p["title"].lower() == "fingerprint per pod"]
    (target,) = panel["targets"]
    grouped = set(re.fullmatch(r"max by \(([^)]*)\) .*", target["expr"]).group(1).replace(" ", "").split(","))
    assert grouped == {"pod", *CONFIG_INFO_LABELS} and not grouped - TARGET_LABELS - set(CONFIG_INFO_LABELS)
    (organize,) = panel["transformations"]
    assert set(organize["options"]["indexByName"]) == grouped  # one column per label, none empty
