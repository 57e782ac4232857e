"""Every setting has one source of default, and sidecar/docs/settings.md is its table.

The table lists every `kv-offload sidecar` flag, `kv-offload operator` flag,
KVOffloadPool spec field and chart value exactly once; each default it states
is the one its source declares (the flag's help, generated from the settings
field), and the CRD's defaults are the operator's constants. The chart's values
against the operator's defaults: tests/chart/test_chart_defaults_match_operator.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kv_offload_operator.pools import kv_transfer, model_config, pool_spec
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.options import OperatorOptions
from kv_offload_operator.quantity import format_bytes
from kv_offload_sidecar.commands import sidecar as sidecar_main
from kv_offload_sidecar.setting_flags import flag_fields, flag_name
from kv_offload_sidecar.settings import SidecarSettings

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "sidecar" / "docs" / "settings.md"
CHART = REPO / "charts" / "kv-offload"
SECTIONS = {"sidecar": "## `kv-offload sidecar`", "operator": "## `kv-offload operator`",
            "crd": "## `KVOffloadPool` spec", "chart": "## Chart values"}
# A cell saying the knob has no default of its own, or lives in one place only.
NONE = "—"
# Values whose only place is values.yaml (explained there), not worth a default cell each.
MAPPING_VALUES = ("operator.resources", "operator.podSecurityContext", "operator.containerSecurityContext",
                  "grafana.dashboards.labels")


def table(section: str) -> dict[str, str]:
    """Knob -> default cell of one section of the table; a knob listed twice fails."""
    text = DOC.read_text().split(SECTIONS[section], 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        for knob in re.findall(r"`([^`]+)`", cells[0]):
            assert knob not in rows, f"{knob} is listed twice in {DOC.name}"
            rows[knob] = cells[1]
    return rows


def show(value: Any) -> str:
    """A default as the table writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return NONE if value is None else str(value)


def parser_of(add_arguments: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def stated_default(action: argparse.Action) -> str:
    """What the help says the default is, else the parser's default."""
    said = re.search(r"\(default (.*)\)$", " ".join((action.help or "").split()))
    if said:
        return said.group(1)
    return "required" if action.required else show(action.default if action.default != [] else None)


def leaves(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """values.yaml's keys as dotted paths (mappings whose keys the user picks are one value)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in MAPPING_VALUES:
            out.update(leaves(value, path + "."))
        else:
            out[path] = value
    return out


def crd_spec() -> dict[str, Any]:
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def crd_fields(node: dict[str, Any], prefix: str = "spec") -> dict[str, dict[str, Any]]:
    """The spec's fields as dotted paths (free-form objects and lists are one field)."""
    props = node.get("properties")
    if not props or node.get("x-kubernetes-preserve-unknown-fields"):
        return {prefix: node}
    out: dict[str, dict[str, Any]] = {}
    for key, child in props.items():
        out.update(crd_fields(child, f"{prefix}.{key}"))
    return out


@pytest.mark.parametrize("section, add_arguments", [("sidecar", sidecar_main.add_arguments),
                                                     ("operator", operator_main.add_arguments)])
def test_the_table_lists_every_flag_once_with_the_default_its_help_states(section, add_arguments):
    actions = flags(parser_of(add_arguments))
    rows = table(section)
    assert sorted(rows) == sorted(actions)
    for flag, action in actions.items():
        assert rows[flag] == stated_default(action), flag


@pytest.mark.parametrize("cls, add_arguments", [(SidecarSettings, sidecar_main.add_arguments),
                                                 (OperatorOptions, operator_main.add_arguments)])
def test_each_settings_flag_takes_its_default_from_its_field_alone(cls, add_arguments):
    actions = flags(parser_of(add_arguments))
    for f, spec in flag_fields(cls):
        action = actions[flag_name(f, spec)]
        assert action.dest == f.name
        if spec.default_text:
            assert action.default is None and f"(default {spec.default_text})" in action.help
        elif f.default is not dataclasses.MISSING:
            assert action.default == f.default and type(action.default) is type(f.default), f.name


def test_the_pools_defaults_for_the_sidecar_are_a_bare_sidecars_and_the_operators():
    sidecar = {f.name: f.default for f, _ in flag_fields(SidecarSettings)}
    operator = {f.name: f.default for f in dataclasses.fields(OperatorOptions)}
    for name, pool_default in (("base_port", pool_spec.DEFAULT_BASE_PORT), ("data_port", pool_spec.DEFAULT_DATA_PORT),
                               ("prefill_tokens_per_second", pool_spec.DEFAULT_PREFILL_TOKENS_PER_SECOND),
                               ("peer_copies", pool_spec.DEFAULT_PEER_COPIES)):
        assert sidecar[name] == pool_default == operator[f"sidecar_{name}"], name
    assert sidecar["transport"] == pool_spec.DEFAULT_TRANSPORT == "ucx"
    # The one difference, on purpose: a pool's store is sized for a GPU node, a bare sidecar's for a laptop.
    assert (sidecar["capacity_bytes"], pool_spec.DEFAULT_CAPACITY_BYTES) == (1 << 30, 4 << 30)


def test_the_table_lists_every_pool_spec_field_once():
    assert sorted(table("crd")) == sorted(crd_fields(crd_spec()))


def test_the_crds_defaults_are_the_operators_constants_and_the_tables():
    fields, rows = crd_fields(crd_spec()), table("crd")
    declared = {"spec.sidecar.ucxTransports": pool_spec.DEFAULT_UCX_TRANSPORTS,
                "spec.sidecar.rdma.ipcLock": False,
                "spec.keyRotationGraceSeconds": pool_spec.DEFAULT_KEY_ROTATION_GRACE_SECONDS,
                "spec.modelConfigRef.key": model_config.DEFAULT_KEY}
    assert {path: node["default"] for path, node in fields.items() if "default" in node} == declared
    described = {"spec.sidecar.capacityBytes": ("defaults to", format_bytes(pool_spec.DEFAULT_CAPACITY_BYTES)),
                 "spec.injectKVTransferConfig.cpuBytesToUse": ("Default", format_bytes(kv_transfer.DEFAULT_CPU_BYTES)),
                 "spec.injectKVTransferConfig.blockSize": ("Default", str(kv_transfer.DEFAULT_BLOCK_SIZE_TOKENS))}
    for path, (words, value) in described.items():
        assert f"{words} {value}." in " ".join(fields[path]["description"].split()), path
    for path in fields:
        expected = show(declared[path]) if path in declared else described.get(path, ("", rows[path]))[1]
        assert rows[path] == expected, path


@pytest.mark.parametrize("path, flag", [("spec.sidecar.image", "--sidecar-image"),
                                        ("spec.sidecar.basePort", "--sidecar-base-port"),
                                        ("spec.sidecar.dataPort", "--sidecar-data-port"),
                                        ("spec.sidecar.prefillTokensPerSecond", "--sidecar-prefill-tokens-per-second"),
                                        ("spec.sidecar.peerCopies", "--sidecar-peer-copies")])
def test_pool_fields_defaulted_by_the_operator_name_its_flag(path, flag):
    assert table("crd")[path] == f"the operator's {flag}"
    assert flag in flags(parser_of(operator_main.add_arguments))


def test_the_table_lists_every_chart_value_once_and_its_default_where_it_states_one():
    values = leaves(yaml.safe_load((CHART / "values.yaml").read_text()))
    rows = table("chart")
    assert sorted(rows) == sorted(values)
    for key, cell in rows.items():
        assert cell in (NONE, show(values[key])), key
