"""Reading the chart's Grafana dashboard: its PromQL, with Grafana's variables filled in."""

from __future__ import annotations

import json
import re
from typing import Any

from chart_support import CHART

DASHBOARD = CHART / "dashboards" / "kv-offload.json"

# Values for Grafana's variables, so the expressions become plain PromQL.
# Ranges are long enough to cover a whole test run in a fresh Prometheus.
GRAFANA_VARIABLES = {
    "__rate_interval": "10m",
    "__range": "10m",
    "__interval": "1m",
    "namespace": "kv-offload-test",
    "pool": "demo",
}
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$", re.S)

# PromQL words that are neither functions nor metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "atan2", "inf", "nan", "start", "end"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?")


def load_dashboard() -> dict[str, Any]:
    """The dashboard JSON shipped in the chart."""
    return json.loads(DASHBOARD.read_text())


def panels_in_reading_order(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Panels sorted top to bottom, left to right, as a person reads the dashboard."""
    return sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def fill_variables(expr: str) -> str:
    """The expression with Grafana's variables replaced; KeyError names an unknown variable."""
    return _VARIABLE.sub(lambda m: GRAFANA_VARIABLES[m.group(1)], expr)


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable's series selector."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = _LABEL_VALUES.match(query.strip())
            assert match, f"variable {variable['name']}: only label_values(selector, label) is used"
            found.append((f"variable {variable['name']}", match["selector"]))
    return found


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (bare identifiers that are not calls or keywords)."""
    text = _STRING.sub('""', expr)
    names_in_braces = set(re.findall(r'__name__\s*=\s*""', text))
    assert not names_in_braces, f"select metrics by name, not by __name__: {expr}"
    while _BRACES.search(text):
        text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names
