"""The chart's sidecar.dataPlane reaches the operator as its pools' default data plane
(--sidecar-transport / --sidecar-lanes), and from there the injected sidecar's --transport and
--lanes; unset, a pool's transport is the pod's (tcp beside a GPU) and its lanes the sidecar's."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from chart_support import find
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.options import OperatorOptions
from kv_offload_operator.pools import pool_spec
from kv_offload_operator.webhook import pod_patch


def _operator_args(objects: list[dict[str, Any]]) -> argparse.Namespace:
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_main.add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def _pool_spec(args: argparse.Namespace, pool_sidecar: dict[str, Any]) -> pool_spec.SidecarSpec:
    options = OperatorOptions(**{name: getattr(args, name) for name in (
        "sidecar_base_port", "sidecar_data_port", "sidecar_prefill_tokens_per_second", "sidecar_peer_copies",
        "sidecar_transport", "sidecar_lanes")}, sidecar_image="i")
    return pool_spec.SidecarSpec.with_operator_defaults({"spec": {"sidecar": pool_sidecar}}, options)


def _flags(spec: pool_spec.SidecarSpec) -> dict[str, str]:
    argv = pod_patch.sidecar_container(pool_name="llama", namespace="inference", sidecar=spec, dp_indices=(0,),
                                       shm_volume=pod_patch.SHM_VOLUME)["args"]
    return dict(zip(argv[1::2], argv[2::2]))


def test_by_default_the_chart_leaves_the_data_plane_to_each_pod_and_its_lanes_to_the_sidecar(render) -> None:
    args = _operator_args(render())
    assert (args.sidecar_transport, args.sidecar_lanes) == ("", pool_spec.DEFAULT_LANES)
    spec = _pool_spec(args, {})
    assert (spec.transport_given, spec.lanes) == (False, 0)  # the webhook picks tcp beside a GPU
    assert (_flags(spec)["--transport"], _flags(spec).get("--lanes")) == (pool_spec.DEFAULT_TRANSPORT, None)


def test_the_charts_data_plane_is_the_default_of_pools_that_set_none(render) -> None:
    args = _operator_args(render({"sidecar": {"dataPlane": {"transport": "tcp", "lanes": 4}}}))
    assert (args.sidecar_transport, args.sidecar_lanes) == ("tcp", 4)
    flags = _flags(_pool_spec(args, {}))
    assert (flags["--transport"], flags["--lanes"]) == ("tcp", "4")
    own = _flags(_pool_spec(args, {"dataPlane": {"transport": "ucx", "lanes": 2}}))
    assert (own["--transport"], own["--lanes"]) == ("ucx", "2")


@pytest.mark.parametrize("plane, words", [({"transport": "rdma"}, "transport"), ({"lanes": 9}, "lanes"),
                                          ({"lanes": -1}, "lanes"), ({"threads": 2}, "threads")])
def test_the_charts_schema_refuses_a_data_plane_the_sidecar_would_refuse(render_error, plane, words) -> None:
    assert words in render_error({"sidecar": {"dataPlane": plane}})
