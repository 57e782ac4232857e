"""SidecarMetrics: the names dashboards read, fixed label sets, pre-created series."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_sidecar.metrics import (
    BUILD_INFO_LABELS,
    CONFIG_INFO_LABELS,
    FETCH_RESULTS,
    HANDSHAKE_REASONS,
    LABEL_VALUES,
    LOOKUP_RESULTS,
    PEER_STATES,
    PROTOCOL_ERROR_REASONS,
    SidecarMetrics,
    exported_metric_names,
)
from kv_offload_sidecar import __version__
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

# Sample names the dashboards and alerts read.
DASHBOARD_SAMPLE_NAMES = {
    "kv_offload_chunk_lookups_total",
    "kv_offload_peer_bytes_total",
    "kv_offload_peer_fetch_duration_seconds_bucket",
    "kv_offload_peer_fetch_duration_seconds_count",
    "kv_offload_peer_fetch_duration_seconds_sum",
    "kv_offload_peer_fetches_total",
    "kv_offload_handshakes_total",
    "kv_offload_peers",
    "kv_offload_store_used_bytes",
    "kv_offload_store_capacity_bytes",
    "kv_offload_store_chunks",
    "kv_offload_evictions_total",
    "kv_offload_integrity_failures_total",
    "kv_offload_protocol_errors_total",
    "kv_offload_lookup_messages_total",
    "kv_offload_config_info",
}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> SidecarMetrics:
    return SidecarMetrics(registry)


def _samples(registry: CollectorRegistry) -> Iterator[tuple[str, dict[str, str], float]]:
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), sample.value


def test_the_sample_names_dashboards_read_are_exported(
    metrics: SidecarMetrics, registry: CollectorRegistry
) -> None:
    names = exported_metric_names(registry)
    assert DASHBOARD_SAMPLE_NAMES <= names
    assert all(name.startswith("kv_offload_") for name in names)


def test_exported_names_match_the_text_exposition(
    metrics: SidecarMetrics, registry: CollectorRegistry
) -> None:
    assert exported_metric_names(registry) == {name for name, _, _ in _samples(registry)}


def test_every_allowed_label_series_is_precreated_at_zero(
    metrics: SidecarMetrics, registry: CollectorRegistry
) -> None:
    series = {(name, tuple(sorted(labels.items()))): value for name, labels, value in _samples(registry)}
    for result in LOOKUP_RESULTS:
        assert series[("kv_offload_chunk_lookups_total", (("result", result),))] == 0
    for result in FETCH_RESULTS:
        assert series[("kv_offload_peer_fetches_total", (("result", result),))] == 0
    for state in PEER_STATES:
        assert series[("kv_offload_peers", (("state", state),))] == 0
    for reason in PROTOCOL_ERROR_REASONS:
        assert series[("kv_offload_protocol_errors_total", (("reason", reason),))] == 0
    assert series[("kv_offload_handshakes_total", (("reason", "ok"), ("result", "accepted")))] == 0
    for reason in HANDSHAKE_REASONS[1:]:
        key = ("kv_offload_handshakes_total", (("reason", reason), ("result", "rejected")))
        assert series[key] == 0
    for direction in ("sent", "received"):
        assert series[("kv_offload_peer_bytes_total", (("direction", direction),))] == 0


def test_label_values_come_only_from_the_fixed_sets_after_use(
    metrics: SidecarMetrics, registry: CollectorRegistry
) -> None:
    metrics.chunk_lookups.labels(result="peer_hit").inc(3)
    metrics.handshakes.labels(result="rejected", reason="fingerprint_mismatch").inc()
    metrics.peer_fetch_duration.observe(0.02)
    metrics.peers.labels(state="connected").set(2)
    metrics.set_config_info(fingerprint="0123456789abcdef", transport="tcp")
    allowed_free_labels = {"le"} | set(CONFIG_INFO_LABELS) | set(BUILD_INFO_LABELS)
    for name, labels, _ in _samples(registry):
        family = name.removesuffix("_total").removesuffix("_created")
        fixed = LABEL_VALUES.get(family, {})
        for label, value in labels.items():
            if label in fixed:
                assert value in fixed[label], f"{name}{{{label}={value!r}}} is outside the fixed set"
            else:
                assert label in allowed_free_labels, f"{name} has unexpected label {label!r}"
                if label in CONFIG_INFO_LABELS:
                    assert name == "kv_offload_config_info"
                if label in BUILD_INFO_LABELS:
                    assert name == "kv_offload_build_info"


def test_counters_move_the_exposed_series(metrics: SidecarMetrics, registry: CollectorRegistry) -> None:
    metrics.peer_bytes.labels(direction="received").inc(4096)
    metrics.evictions.inc()
    metrics.store_used_bytes.set(8192)
    series = {(n, tuple(sorted(labels.items()))): v for n, labels, v in _samples(registry)}
    assert series[("kv_offload_peer_bytes_total", (("direction", "received"),))] == 4096
    assert series[("kv_offload_evictions_total", ())] == 1
    assert series[("kv_offload_store_used_bytes", ())] == 8192


def test_config_info_shows_the_fingerprint_transport_and_model_identity_digest_only(
        metrics: SidecarMetrics, registry: CollectorRegistry) -> None:
    metrics.set_config_info(fingerprint="00ff00ff00ff00ff", transport="ucx")
    infos = [labels for name, labels, value in _samples(registry) if name == "kv_offload_config_info"]
    assert infos == [{"fingerprint": "00ff00ff00ff00ff", "transport": "ucx", "model_identity": ""}]
    metrics.set_config_info(fingerprint="00ff00ff00ff00ff", transport="ucx",
                            model_identity="3f2a3f2a3f2a3f2a")
    infos = [labels for name, labels, value in _samples(registry) if name == "kv_offload_config_info"]
    assert infos == [{"fingerprint": "00ff00ff00ff00ff", "transport": "ucx",
                      "model_identity": "3f2a3f2a3f2a3f2a"}]


def test_a_second_metrics_set_on_the_same_registry_is_refused(
    metrics: SidecarMetrics, registry: CollectorRegistry
) -> None:
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        SidecarMetrics(registry)


def test_reason_labels_match_the_protocol_and_handshake_modules() -> None:
    from kv_offload_sidecar.data import protocol
    from kv_offload_sidecar.peers import handshake

    assert set(protocol.PROTOCOL_ERROR_REASONS) == set(PROTOCOL_ERROR_REASONS)
    assert set(handshake.REASONS) == set(HANDSHAKE_REASONS) - {"ok"}


def test_build_info_names_the_release_and_its_wire_version(
        metrics: SidecarMetrics, registry: CollectorRegistry) -> None:
    metrics.set_build_info(wire=WIRE_VERSION)
    infos = [(labels, value) for name, labels, value in _samples(registry) if name == "kv_offload_build_info"]
    assert infos == [({"version": __version__, "wire": WIRE_VERSION}, 1.0)]
