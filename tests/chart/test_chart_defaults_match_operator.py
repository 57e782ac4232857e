"""The chart's values are the operator's defaults: what the default chart passes to `kv-offload operator`
equals what the operator does without the flag, and the CRD states those same defaults."""

from __future__ import annotations

import argparse
import dataclasses
import re

import yaml
from chart_support import CHART, find
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.options import OperatorOptions
from kv_offload_sidecar.setting_flags import flag_fields, flag_name

# Flags the chart sets for its own deployment, not as a default: its namespace scope, its
# mounted certificate and Service name, its peering object, and its own image for the sidecar.
DEPLOYMENT_FLAGS = {"namespaces", "clusterwide", "webhook_cert_dir", "webhook_host", "peering_name",
                    "sidecar_image"}


def _passed_options(objects) -> dict[str, object]:
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    flags = container["args"][1:]
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_main.add_arguments(parser)
    args = parser.parse_args(flags)
    given = {flag.split("=", 1)[0] for flag in flags}
    return {f.name: getattr(args, f.name) for f, spec in flag_fields(OperatorOptions)
            if flag_name(f, spec) in given}


def test_every_value_the_default_chart_passes_to_the_operator_is_its_default(render):
    passed = _passed_options(render())
    defaults = {f.name: f.default for f in dataclasses.fields(OperatorOptions)}
    assert {name: passed[name] for name in passed if name not in DEPLOYMENT_FLAGS} == {
        name: defaults[name] for name in passed if name not in DEPLOYMENT_FLAGS}
    assert set(passed) - DEPLOYMENT_FLAGS >= {"webhook_port", "health_port", "metrics_port",
                                              "ready_peers_check_seconds", "peering_lifetime_seconds",
                                              "sidecar_base_port", "sidecar_data_port",
                                              "sidecar_prefill_tokens_per_second", "sidecar_peer_copies"}


def test_the_crd_states_the_charts_sidecar_values_as_the_operators_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["sidecar"]
    crd = " ".join((CHART / "files" / "crd-kvoffloadpools.yaml").read_text().split())
    stated = dict(re.findall(r"\(the chart's sidecar\.(\w+), ([^)]+)\)", crd))
    options = {"controlPort": "sidecar_base_port", "dataPort": "sidecar_data_port",
               "prefillTokensPerSecond": "sidecar_prefill_tokens_per_second", "peerCopies": "sidecar_peer_copies"}
    assert sorted(stated) == sorted(options)
    defaults = {f.name: f.default for f in dataclasses.fields(OperatorOptions)}
    for key, value in stated.items():
        assert value == str(values[key]), key
        assert type(defaults[options[key]])(value) == defaults[options[key]], key
