"""The store window's end condition: the engine's counter, read without collecting the rest."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kv_offload_tools.vllm_harness.decode_latency import _counter


class _Elsewhere:
    """Another metric of the process: collecting it is what a per-step read must not do."""

    collected = 0

    def collect(self):
        _Elsewhere.collected += 1
        return []

    def describe(self):
        return []


def test_a_store_windows_counter_sums_its_labelled_samples_and_collects_nothing_else() -> None:
    registry = CollectorRegistry()
    written = Counter("vllm:kv_offload_tiering_write_bytes", "bytes written", ["tier", "engine"],
                      registry=registry)
    written.labels(tier="kv-offload", engine="0").inc(3)
    written.labels(tier="kv-offload", engine="1").inc(4)
    written.labels(tier="cpu", engine="0").inc(100)
    registry.register(_Elsewhere())
    got = _counter("vllm:kv_offload_tiering_write_bytes", {"tier": "kv-offload"}, registry)
    assert got == 7.0
    assert _counter("vllm:kv_offload_tiering_write_bytes_total", {"tier": "cpu"}, registry) == 100.0
    assert _Elsewhere.collected == 0


def test_a_counter_not_registered_reads_zero() -> None:
    assert _counter("vllm:no_such_counter", {}, CollectorRegistry()) == 0.0
