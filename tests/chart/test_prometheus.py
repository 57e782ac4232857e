"""A real Prometheus scrapes real sidecars that exchanged chunks; the dashboard's hit ratio is right.

Three `kv-offload sidecar` processes (LocalPool) share chunks over TCP on
127.0.0.1; Debian's `prometheus` scrapes their /metrics every second with the
labels the chart's PodMonitor gives (namespace, kv_offload_io_pool, pod). The
dashboard's own hit-ratio expressions, evaluated through Prometheus' HTTP API,
must equal the ratio implied by the sidecars' counters.

Why the equality can be exact: rate()/increase() extrapolate per series. All
series of one target share scrape timestamps and start at 0 (the sidecar
pre-creates them), and Prometheus has scraped every target before the first
lookup, so every series of a target is scaled by the same factor and the
ratio is unchanged. The engine lookups all go through one sidecar (pod 1
serving prompts whose prefixes pods 0 and 2 computed), so no second target
with another factor enters the sums.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import tool_path
from dashboard_support import (
    GRAFANA_VARIABLES,
    dashboard_expressions,
    fill_variables,
    load_dashboard,
    panels_in_reading_order,
)
from kv_offload_testing.local_pool import LocalPool, free_port_block
from kv_offload_testing.scrape import parse_metrics
from waiting import wait_for

LOOKUPS = "kv_offload_chunk_lookups_total"
RESULTS = ("local_hit", "peer_hit", "miss")
# Labels the chart's PodMonitor puts on every sidecar target.
TARGET_LABELS = {"namespace": GRAFANA_VARIABLES["namespace"],
                 "kv_offload_io_pool": GRAFANA_VARIABLES["pool"]}
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Seconds an engine lookup or load may take on a loaded test machine.
DEADLINE = 15.0


class Prometheus:
    """A Prometheus server on a free loopback port with a temporary TSDB."""

    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        self.workdir = workdir
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "kv-offload-sidecars",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [address], "labels": {**TARGET_LABELS, "pod": pod}}
                                   for pod, address in targets.items()],
            }],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port_block(1)
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [tool_path("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def ready(self) -> bool:
        """Whether /-/ready answers 200; fails at once with the log when the server exited."""
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with _NO_PROXY.open(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def wait_ready(self) -> None:
        wait_for("prometheus ready", self.ready)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at the server's now; fails the test on any API error."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with _NO_PROXY.open(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, expr: str, expected: float) -> None:
        """Until ``expr`` evaluates to ``expected`` (the scrapes caught up)."""
        wait_for(f"{expr} to be {expected}", lambda: self.scalar(expr) == expected)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def chunk(tag: str, i: int) -> bytes:
    """A chunk key: 8 bytes of prefix hash followed by KV-cache group 0 (4 bytes big-endian)."""
    return f"{tag}{i:07d}".encode()[:8] + (0).to_bytes(4, "big")


def fill(i: int, view: memoryview) -> None:
    view[:8] = i.to_bytes(8, "big")


@pytest.fixture(scope="module")
def scraped_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPool, Prometheus]]:
    """Three sidecars, scraped by a real Prometheus from before their first lookup."""
    workdir = tmp_path_factory.mktemp("prometheus")
    # Generous deadlines: a late lookup or fetch is a miss, which would change the counts.
    with LocalPool(3, fetch_deadline_seconds=20.0) as pool:
        prometheus = Prometheus(workdir, {sc.identity: sc.address for sc in pool.sidecars})
        try:
            prometheus.wait_ready()
            selector = ", ".join(f'{k}="{v}"' for k, v in TARGET_LABELS.items())
            # Every target scraped (its counters at 0) before any lookup happens.
            prometheus.wait_value(f'count(up{{{selector}}} == 1)', 3.0)
            prometheus.wait_value(f'count({LOOKUPS}{{result="miss", {selector}}} == 0)', 3.0)
            yield pool, prometheus
        finally:
            prometheus.stop()


def exchange_chunks(pool: LocalPool) -> None:
    """Pods 0 and 2 compute prefixes; pod 1 serves prompts that reuse them, and some it cannot."""
    shared_a = [chunk("a", i) for i in range(6)]
    shared_b = [chunk("b", i) for i in range(4)]
    own = [chunk("c", i) for i in range(3)]
    assert pool.client(0).store(shared_a, fill) == 6
    assert pool.client(2).store(shared_b, fill) == 4
    serving = pool.client(1)
    assert serving.store(own, fill) == 3
    pool.wait_directory_current()
    assert serving.lookup(shared_a + [chunk("x", 0)], timeout=DEADLINE).peer == 6
    assert serving.load(shared_a, lambda i, view: None, timeout=DEADLINE) == 6  # fetched from pod 0
    reply = serving.lookup(own + shared_b + [chunk("x", 1), chunk("x", 2)], timeout=DEADLINE)
    assert (reply.local, reply.peer) == (3, 4)
    # The pool keeps one copy (--peer-copies drop): still pod 0's, not kept after the load.
    assert serving.lookup(shared_a[:3], timeout=DEADLINE).peer == 3


def sidecar_counters(pool: LocalPool) -> dict[str, dict[str, float]]:
    """{pod: {result: kv_offload_chunk_lookups_total}} read from each sidecar's own /metrics."""
    counters = {}
    for sc in pool.sidecars:
        samples = parse_metrics(sc.metrics_text())
        counters[sc.identity] = {result: samples[(LOOKUPS, frozenset({("result", result)}))]
                                 for result in RESULTS}
    return counters


def test_dashboard_hit_ratio_through_prometheus_equals_the_sidecars_counters(scraped_pool):
    pool, prometheus = scraped_pool
    exchange_chunks(pool)
    counters = sidecar_counters(pool)
    assert sum(counters["sidecar-1"].values()) > 0 and all(counters["sidecar-1"].values())
    assert pool[0].metric("kv_offload_peer_bytes_total", direction="sent") > 0
    assert pool[1].metric("kv_offload_peer_bytes_total", direction="received") > 0
    totals = {r: sum(c[r] for c in counters.values()) for r in RESULTS}
    # Only the serving pod looked chunks up (see the module docstring).
    assert {pod for pod, c in counters.items() if any(c.values())} == {"sidecar-1"}
    expected = {r: totals[r] / sum(totals.values()) for r in RESULTS}
    prometheus.wait_value(f"sum({LOOKUPS})", sum(totals.values()))

    hit_panel = panels_in_reading_order(load_dashboard())[0]
    by_legend = {t["legendFormat"]: fill_variables(t["expr"]) for t in hit_panel["targets"]}
    measured = {result: prometheus.scalar(by_legend[legend])
                for legend, result in (("local", "local_hit"), ("peer", "peer_hit"), ("miss", "miss"))}
    assert measured == pytest.approx(expected, rel=1e-9)
    assert sum(measured.values()) == pytest.approx(1.0)

    (share_panel,) = [p for p in load_dashboard()["panels"] if "by result" in p["title"]]
    (target,) = share_panel["targets"]
    shares = {s["metric"]["result"]: float(s["value"][1])
              for s in prometheus.query(fill_variables(target["expr"]))}
    assert shares == pytest.approx(expected, rel=1e-9)


def test_every_dashboard_expression_returns_data_from_live_sidecars(scraped_pool):
    pool, prometheus = scraped_pool
    if pool[1].metric(LOOKUPS) == 0:  # when run alone, exchange chunks first
        exchange_chunks(pool)
        prometheus.wait_value(f"sum({LOOKUPS})", pool[1].metric(LOOKUPS))
    prometheus.wait_value(
        "sum(kv_offload_peer_fetch_duration_seconds_count)",
        sum(sc.metric("kv_offload_peer_fetch_duration_seconds_count") for sc in pool.sidecars))
    for where, expr in dashboard_expressions(load_dashboard()):
        result = prometheus.query(fill_variables(expr))
        assert result, f"{where} returned no series from live sidecars: {expr}"
        for series in result:
            value = float(series["value"][1])
            assert not math.isinf(value), f"{where} returned {value}"
    p99 = prometheus.scalar(fill_variables(next(
        t["expr"] for p in load_dashboard()["panels"] if "latency" in p["title"].lower()
        for t in p["targets"] if t["legendFormat"] == "p99")))
    assert p99 is not None and 0 < p99 <= 10


def test_per_pod_panels_show_each_sidecars_hit_ratio_fingerprint_and_that_all_are_up(scraped_pool):
    pool, prometheus = scraped_pool
    if pool[1].metric(LOOKUPS) == 0:  # when run alone, exchange chunks first
        exchange_chunks(pool)
    counters = sidecar_counters(pool)
    prometheus.wait_value(f"sum({LOOKUPS})", sum(sum(c.values()) for c in counters.values()))
    panels = {p["title"].lower(): p for p in load_dashboard()["panels"]}

    (per_pod,) = panels["chunk hit ratio per pod"]["targets"]
    ratios = {s["metric"]["pod"]: float(s["value"][1]) for s in prometheus.query(fill_variables(per_pod["expr"]))}
    serving = counters["sidecar-1"]
    assert ratios["sidecar-1"] == pytest.approx(
        (serving["local_hit"] + serving["peer_hit"]) / sum(serving.values()), rel=1e-9)

    up = {t["legendFormat"]: prometheus.scalar(fill_variables(t["expr"])) for t in panels["sidecars up"]["targets"]}
    assert up == {"up": 3.0, "scraped": 3.0}

    (fingerprints,) = panels["fingerprint per pod"]["targets"]
    series = prometheus.query(fill_variables(fingerprints["expr"]))
    rows = {s["metric"]["pod"]: s["metric"]["fingerprint"] for s in series}
    assert rows == {sc.identity: pool.config.fingerprint for sc in pool.sidecars}
