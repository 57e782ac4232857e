"""READY PEERS without a cluster: which pods are asked, how a sidecar's /metrics is read and counted.

The operator with real sidecars behind emulated pods is in test_operator_kmock.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kv_offload_operator.pools import ready_peers
from kv_offload_operator.pools.pool_pod import INJECTED_ANNOTATION, METRICS_PORT_NAME
from kv_offload_sidecar import __version__
from kv_offload_sidecar.metrics import PEER_STATES, SidecarMetrics
from kv_offload_sidecar.peers.wire_window import WIRE_VERSION
from pool_support import inject, pod, sidecar_spec, vllm
from prometheus_client import CollectorRegistry, generate_latest

CRD_PATH = Path(__file__).parents[2] / "charts" / "kv-offload" / "files" / "crd-kvoffloadpools.yaml"


def exposition(fingerprint: str | None = "ab" * 8, model_identity: str = "", **peers: int) -> str:
    """A sidecar's whole /metrics text (every family it exports) with these peer session counts."""
    metrics = SidecarMetrics(CollectorRegistry())
    for state, n in peers.items():
        metrics.peers.labels(state=state).set(n)
    metrics.handshakes.labels(result="accepted", reason="ok").inc(7)
    if fingerprint is not None:
        metrics.set_config_info(fingerprint=fingerprint, transport="tcp", model_identity=model_identity)
    return generate_latest(metrics.registry).decode()


def test_a_sidecars_peer_states_and_fingerprint_are_read_from_its_whole_exposition() -> None:
    assert ready_peers.read_metrics(exposition(connected=2, rejected=1)) == ready_peers.SidecarAnswer(
        {"connecting": 0, "connected": 2, "backoff": 0, "rejected": 1}, "ab" * 8, "")
    assert ready_peers.read_metrics(exposition(model_identity="12" * 8)).model_identity == "12" * 8
    older = 'kv_offload_config_info{fingerprint="abababababababab",transport="tcp"} 1.0\n'
    assert ready_peers.read_metrics(older) == ready_peers.SidecarAnswer(
        dict.fromkeys(PEER_STATES, 0), "ab" * 8, None)
    assert ready_peers.read_metrics(exposition(None)) == ready_peers.SidecarAnswer(dict.fromkeys(PEER_STATES, 0))
    assert ready_peers.read_metrics("# a metrics page without the families\nup 1\n") == \
        ready_peers.SidecarAnswer(dict.fromkeys(PEER_STATES, 0), None)
    with pytest.raises(ValueError):
        ready_peers.read_metrics('kv_offload_peers{state="connected"} not-a-number\n')


def test_a_sidecar_counts_when_it_runs_the_pools_fingerprint_and_reports_a_connected_peer() -> None:
    fp, old = "ab" * 8, "cd" * 8

    def at(fingerprint: str = fp) -> ready_peers.SidecarEndpoint:
        return ready_peers.SidecarEndpoint("p", fingerprint, "10.0.0.1", 5710)

    def says(fingerprint: str | None = fp, **states: int) -> ready_peers.SidecarAnswer:
        return ready_peers.SidecarAnswer(states, fingerprint)

    counted = ready_peers.count([
        (at(), says(connected=2)), (at(), says(connected=1, backoff=1)),
        (at(), says(rejected=3)),  # every handshake rejected
        (at(), says(connecting=2)),  # not connected yet
        (at(), None),  # did not answer
        (at(old), None),  # did not answer either, whatever its pod says
        (at(old), says(old, connected=4)),  # an older generation, still meshed with its own
        (at(), says(old, connected=4)),  # another sidecar answering at a reused IP
        (at(), says(None, connected=1)),  # no config_info: the pod's injected fingerprint
        (at(old), says(None, connected=5)),
    ], fp)
    assert counted.ready_peers == 3 and counted.unanswered == 2
    assert counted.peer_states == {"connecting": 2, "connected": 4, "backoff": 1, "rejected": 3}
    assert counted.status() == {"readyPeers": 3, "peerStates": counted.peer_states, "unansweredSidecars": 2,
                                "modelIdentities": [], "sidecarVersions": [{"version": "", "wire": "", "pods": 5}]}
    assert ready_peers.count([], fp).status() == {"readyPeers": 0, "peerStates": dict.fromkeys(PEER_STATES, 0),
                                                  "unansweredSidecars": 0, "modelIdentities": [],
                                                  "sidecarVersions": []}


def test_model_identities_are_counted_per_pod_over_the_sidecars_of_the_pools_fingerprint() -> None:
    fp, old, new = "ab" * 8, "0a" * 8, "0b" * 8

    def says(identity: str | None, fingerprint: str = fp) -> tuple[ready_peers.SidecarEndpoint,
                                                                   ready_peers.SidecarAnswer]:
        return (ready_peers.SidecarEndpoint("p", fp, "10.0.0.1", 5710),
                ready_peers.SidecarAnswer({"connected": 1}, fingerprint, identity))

    counted = ready_peers.count([
        says(old), says(old), says(new),  # a rolling update to other weights, midway
        says(""),  # its engine has not attached yet
        says(None),  # a sidecar older than model identities: not counted
        says(new, fingerprint="cd" * 8),  # an older fingerprint's sidecar: not this pool's count
    ], fp)
    assert counted.model_identities == ((old, 2), ("", 1), (new, 1))
    assert counted.status()["modelIdentities"] == [
        {"identity": old, "pods": 2}, {"identity": "", "pods": 1}, {"identity": new, "pods": 1}]
    assert counted.mixed_model_identities
    settled = ready_peers.count([says(new), says(new), says("")], fp)
    assert not settled.mixed_model_identities  # one identity and a pod still loading
    shown = ready_peers.pool_peer_status({"fingerprint": fp, **settled.status()})
    assert settled.shown_in(shown)
    assert not counted.shown_in(shown)


def test_the_releases_a_pool_runs_are_counted_per_pod_from_build_info() -> None:
    metrics = SidecarMetrics(CollectorRegistry())
    metrics.set_config_info(fingerprint="ab" * 8, transport="tcp")
    metrics.set_build_info(wire=WIRE_VERSION)
    today = ready_peers.read_metrics(generate_latest(metrics.registry).decode())
    assert today.release == (__version__, WIRE_VERSION)
    previous = ready_peers.read_metrics(exposition())  # the last release shows no build_info
    assert previous.release is None
    at = ready_peers.SidecarEndpoint("p", "ab" * 8, "10.0.0.1", 5710)
    counted = ready_peers.count([(at, today), (at, previous), (at, today)], "ab" * 8)
    assert counted.status()["sidecarVersions"] == [
        {"version": __version__, "wire": WIRE_VERSION, "pods": 2}, {"version": "", "wire": "", "pods": 1}]
    shown = ready_peers.pool_peer_status({"fingerprint": "ab" * 8, **counted.status()})
    assert counted.shown_in(shown)
    upgraded = ready_peers.count([(at, today)] * 3, "ab" * 8)
    assert not upgraded.shown_in(shown)  # the rollout's end is written


def test_the_asked_address_is_the_pod_ip_and_the_kvo_metrics_port_the_webhook_gives_the_sidecar() -> None:
    injected = inject(pod(vllm()), basePort=6710)
    injected["status"] = {"podIP": "10.1.2.3", "initContainerStatuses": [
        {"name": "kv-offload-sidecar", "started": True, "state": {"running": {}}}]}
    annotations = injected["metadata"]["annotations"]
    assert ready_peers.sidecar_is_running(injected["status"], annotations)
    endpoint = ready_peers.sidecar_endpoint("p", annotations, injected["spec"], injected["status"])
    (sidecar,) = [c for c in injected["spec"]["initContainers"] if c["name"] == "kv-offload-sidecar"]
    (metrics,) = [p for p in sidecar["ports"] if p["name"] == METRICS_PORT_NAME]
    assert endpoint == ready_peers.SidecarEndpoint("p", annotations[INJECTED_ANNOTATION], "10.1.2.3",
                                                   metrics["containerPort"])
    assert endpoint.metrics_url == f"http://10.1.2.3:{sidecar_spec(basePort=6710).control_port(0)}/metrics"
    assert ready_peers.SidecarEndpoint("p", "f", "fd00::7", 5710).metrics_url == "http://[fd00::7]:5710/metrics"
    assert ready_peers.SidecarEndpoint("p", "f", None, 5710).metrics_url is None  # no IP yet: cannot answer
    assert ready_peers.SidecarEndpoint("p", "f", "10.1.2.3", None).metrics_url is None


@pytest.mark.parametrize("status, annotated", [
    ({"initContainerStatuses": [{"name": "kv-offload-sidecar", "started": False, "state": {"running": {}}}]}, True),
    ({"initContainerStatuses": [{"name": "kv-offload-sidecar", "started": True,
                                 "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}, True),
    ({"initContainerStatuses": [{"name": "kv-offload-sidecar", "started": True, "state": {"running": {}}}]}, False),
    ({}, True),
])
def test_pods_whose_sidecar_is_not_running_or_not_injected_are_not_asked(status: dict[str, Any],
                                                                         annotated: bool) -> None:
    annotations = {INJECTED_ANNOTATION: "ab" * 8} if annotated else {}
    assert not ready_peers.sidecar_is_running(status, annotations)


def test_the_crd_keeps_every_status_field_the_count_writes() -> None:
    """A structural schema prunes undeclared fields: each one written must be declared."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    written = ready_peers.count([(ready_peers.SidecarEndpoint("p", "f", "10.0.0.1", 5710),
                                  ready_peers.SidecarAnswer({"connected": 1}, "f"))], "f").status()
    assert set(written) <= set(status)
    assert set(written["peerStates"]) == set(status["peerStates"]["properties"]) == set(PEER_STATES)
    identity_item = status["modelIdentities"]["items"]["properties"]
    assert written["modelIdentities"] == [] and set(identity_item) == {"identity", "pods"}
    version_item = status["sidecarVersions"]["items"]["properties"]
    assert set(written["sidecarVersions"][0]) == set(version_item) == {"version", "wire", "pods"}
    assert all(status[k]["type"] == "integer" for k in ("readyPeers", "unansweredSidecars"))
