"""The tier without a sidecar: it runs detached (serving by recomputing), says so once, and attaches later.

One test per part of kv-offload an engine can find missing: the injection (no
side-channel variables: no label, webhook down with ``failurePolicy: Ignore``),
the sidecar (not started, crashed, its ConfigMap or Secret gone: nothing
listens), and something answering that is no sidecar.
"""

import logging
import socket
import socketserver
import threading

import pytest
from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.engine import tier_stats
from kv_offload_sidecar.engine.sidecar_link import (
    DETACHED_REASONS,
    DETACHED_NO_SIDECAR,
    DETACHED_NOT_INJECTED,
    DETACHED_SIDECAR_ERROR,
)
from kv_offload_sidecar.engine.tier_stats import METRIC_DETACHED, StatsReporter, TierStats
from kv_offload_testing.engine_sim import SimulatedEngine, trace_tokens
from kv_offload_testing.local_pool import LocalPool, example_config, free_port_block
from waiting import wait_for

CONFIG = example_config()
LOGGERS = ("kv_offload_sidecar.engine.sidecar_link", "kv_offload_sidecar.engine.vllm_tier",
           "kv_offload_sidecar.engine.tier_transfers")


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name in LOGGERS]


def _serve_requests(engine, n=3):
    """Run ``n`` requests of distinct prompts; each is served (computed) with no hit."""
    for i in range(n):
        result = engine.run_request(trace_tokens([100 + 2 * i, 101 + 2 * i],
                                                 engine.layout.tokens_per_chunk))
        assert (result.chunks, result.hit_chunks, result.loaded_chunks) == (2, 0, 0)


def _detached_engine(monkeypatch, caplog, port, env):
    for name in (ports.ENV_HOST, ports.ENV_PORT):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.INFO)
    return SimulatedEngine(CONFIG, hash_seed="0", host="127.0.0.1", port=port, name="alone",
                           lookup_timeout_seconds=5.0)


@pytest.mark.parametrize("env, reason", [
    ({}, DETACHED_NOT_INJECTED),  # pod admitted without injection: no side-channel variables
    ({ports.ENV_PORT: "5710"}, DETACHED_NO_SIDECAR),  # injected, but no sidecar runs
])
def test_an_engine_with_no_sidecar_serves_every_request_with_one_warning_and_the_reason(
        monkeypatch, caplog, env, reason):
    engine = _detached_engine(monkeypatch, caplog, free_port_block(), env)
    try:
        _serve_requests(engine)
        assert engine.tier.stats.detached == reason
        warnings = _warnings(caplog)
        assert len(warnings) == 1, warnings
        assert f"running detached ({reason})" in warnings[0]
        assert "recomputing" in warnings[0] and METRIC_DETACHED in warnings[0]
        assert engine.tier.stats.bytes_stored == 0 and engine.tier.stats.lookups == 0
    finally:
        engine.close()


class _NotASidecar(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.recv(4096)
        self.request.sendall(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")


def test_something_else_answering_at_the_sidecars_port_is_a_sidecar_error(monkeypatch, caplog):
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _NotASidecar) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        engine = _detached_engine(monkeypatch, caplog, server.server_address[1],
                                  {ports.ENV_PORT: str(server.server_address[1])})
        try:
            _serve_requests(engine)
            assert engine.tier.stats.detached == DETACHED_SIDECAR_ERROR
            warnings = _warnings(caplog)
            assert len(warnings) == 1 and "HTTP 404" in warnings[0], warnings
        finally:
            engine.close()
            server.shutdown()


class _Forwarder:
    """A TCP port that refuses connections until ``open_to`` forwards it to a sidecar's."""

    def __init__(self):
        self.port = free_port_block()
        self._target = None
        self._listener = None

    def open_to(self, target_port):
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        if self._listener is not None:
            self._listener.close()


def test_a_sidecar_that_starts_after_vllm_is_attached_and_the_detached_state_ends(
        monkeypatch, caplog):
    forwarder = _Forwarder()
    engine = _detached_engine(monkeypatch, caplog, forwarder.port,
                              {ports.ENV_PORT: str(forwarder.port)})
    try:
        _serve_requests(engine, 1)
        assert engine.tier.stats.detached == DETACHED_NO_SIDECAR
        with LocalPool(1, config=CONFIG) as pool:
            forwarder.open_to(pool[0].port)
            tokens = trace_tokens([7, 8], engine.layout.tokens_per_chunk)

            def stored():  # the tier tries again every RECONNECT_SECONDS
                return engine.run_request(tokens).stored_chunks == 2 or None
            wait_for("the late sidecar attached", stored)
            assert engine.tier.stats.detached is None
            assert engine.run_request(tokens).hit_chunks == 2
            engine.close()
        assert len(_warnings(caplog)) == 1
        assert any("no longer detached (no_sidecar)" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()
        forwarder.close()


class _Recorded:
    """What vLLM's OffloadingConnectorStats is given (its set_gauge / increase_counter)."""

    def __init__(self):
        self.gauges = {}

    def set_gauge(self, name, value, labels=()):
        self.gauges[(name, labels)] = value

    def increase_counter(self, name, value, labels=()):
        pass


@pytest.mark.parametrize("reason", [None, DETACHED_NOT_INJECTED, DETACHED_NO_SIDECAR])
def test_the_detached_gauge_is_one_for_the_reason_and_zero_for_the_others(monkeypatch, reason):
    monkeypatch.setattr(tier_stats, "connector_stats", _Recorded)
    out = StatsReporter().report(TierStats(detached=reason))
    detached = {labels[0]: v for (name, labels), v in out.gauges.items() if name == METRIC_DETACHED}
    assert detached == {r: int(r == reason) for r in DETACHED_REASONS}
    assert set(tier_stats.metric_definitions()[METRIC_DETACHED].labelnames) == {"reason"}
