"""The chart's sidecar.controlPort / dataPort reach the operator as its pools' default ports, and the
NetworkPolicy opens the same ports."""

from __future__ import annotations

import argparse

from chart_support import find
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.pools import pool_spec
from kv_offload_operator.webhook import pod_patch


def test_the_chart_ports_are_the_operators_defaults_and_the_network_policys_ports(render):
    values = {"sidecar": {"controlPort": 6710, "controlPortCount": 2, "dataPort": 6810},
              "networkPolicy": {"enabled": True, "openAllPortsBetweenPoolPods": False,
                                "pools": [{"name": "llama", "namespace": "inference"}]}}
    objects = render(values)
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_main.add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert (args.sidecar_base_port, args.sidecar_data_port) == (6710, 6810)
    spec = pool_spec.SidecarSpec.from_pool({"spec": {"sidecar": {"transport": "tcp"}}}, default_image="i",
                                           default_base_port=args.sidecar_base_port,
                                           default_data_port=args.sidecar_data_port)
    sidecar = pod_patch.sidecar_container(pool_name="llama", namespace="inference", sidecar=spec,
                                          dp_indices=(0, 1), shm_volume=pod_patch.SHM_VOLUME)
    policy = find(objects, "NetworkPolicy")
    admitted = set()
    for port in policy["spec"]["ingress"][0]["ports"]:
        admitted |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    assert {p["containerPort"] for p in sidecar["ports"]} == admitted == {6710, 6711, 6810}
