"""The chart's sidecar.prefillTokensPerSecond / peerCopies reach the operator as its pools' default
fetch-or-recompute rate and peer-copies policy (--sidecar-prefill-tokens-per-second /
--sidecar-peer-copies), and from there the injected sidecar's flags."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from chart_support import CHART, find
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.pools import pool_spec
from kv_offload_operator.webhook import pod_patch


def _operator_args(objects: list[dict[str, Any]]) -> argparse.Namespace:
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_main.add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def _sidecar_flags(args: argparse.Namespace, pool_sidecar: dict[str, Any]) -> dict[str, str]:
    spec = pool_spec.SidecarSpec.from_pool(
        {"spec": {"sidecar": pool_sidecar}}, default_image="i", default_base_port=args.sidecar_base_port,
        default_data_port=args.sidecar_data_port,
        default_prefill_tokens_per_second=args.sidecar_prefill_tokens_per_second,
        default_peer_copies=args.sidecar_peer_copies)
    argv = pod_patch.sidecar_container(pool_name="llama", namespace="inference", sidecar=spec, dp_indices=(0,),
                                       shm_volume=pod_patch.SHM_VOLUME)["args"]
    return dict(zip(argv[1::2], argv[2::2]))


def test_by_default_the_operator_and_so_every_sidecar_always_fetches_and_drops_peer_copies(render) -> None:
    args = _operator_args(render())
    assert (args.sidecar_prefill_tokens_per_second, args.sidecar_peer_copies) == (0.0, "drop")
    flags = _sidecar_flags(args, {})
    assert (flags["--prefill-tokens-per-second"], flags["--peer-copies"]) == ("0", "drop")


@pytest.mark.parametrize("rate", [12500, 2500.5, 10_000_000, 123456789])
def test_the_chart_values_are_the_default_of_pools_that_set_none(render, rate) -> None:
    """helm prints large numbers in exponent form (1e+07); the operator reads them back exactly."""
    args = _operator_args(render({"sidecar": {"prefillTokensPerSecond": rate, "peerCopies": "cold"}}))
    assert (args.sidecar_prefill_tokens_per_second, args.sidecar_peer_copies) == (float(rate), "cold")
    defaults = _sidecar_flags(args, {})
    assert float(defaults["--prefill-tokens-per-second"]) == rate and defaults["--peer-copies"] == "cold"
    own = _sidecar_flags(args, {"prefillTokensPerSecond": 0, "peerCopies": "drop"})
    assert (own["--prefill-tokens-per-second"], own["--peer-copies"]) == ("0", "drop")


@pytest.mark.parametrize("values, words", [
    ({"sidecar": {"prefillTokensPerSecond": -1}}, "prefillTokensPerSecond"),
    ({"sidecar": {"prefillTokensPerSecond": "fast"}}, "prefillTokensPerSecond"),
    ({"sidecar": {"peerCopies": "keep"}}, "peerCopies"),
])
def test_values_that_cannot_work_are_refused_by_helm_naming_the_key(render_error, values, words) -> None:
    assert words in render_error(values)


def test_readme_documents_both_knobs_with_their_values_and_operator_flags() -> None:
    readme = " ".join((CHART / "README.md").read_text().split())
    for words in ("spec.sidecar", "`prefillTokensPerSecond`", "`sidecar.prefillTokensPerSecond`",
                  "`--sidecar-prefill-tokens-per-second`", "`peerCopies`", "`sidecar.peerCopies`",
                  "`--sidecar-peer-copies`", "`--prefill-tokens-per-second`", "`--peer-copies`",
                  "measured prefill throughput", "vLLM's metrics", "cold end of the fetcher's store"):
        assert words in readme, words
