"""ModelGate: a sidecar shares under the identity its engine gave it, and refuses others."""

from __future__ import annotations

import asyncio

from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.peers.model_gate import ModelGate
from prometheus_client import CollectorRegistry
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY

FINGERPRINT = "0123456789abcdef"
OTHER = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "weights": "files:9c1d000000000000"})


class Shown:
    """What the sidecar's real metrics show of the gate: the adopted digest, the refusals."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = SidecarMetrics(self.registry)

    def adopted(self) -> list[str]:
        digests = [s.labels.get("model_identity", "") for f in self.registry.collect() for s in f.samples
                   if s.name == "kv_offload_config_info"]
        return [d for d in digests if d]

    def refusals(self) -> int:
        return int(self.registry.get_sample_value("kv_offload_engine_refusals_total") or 0)


def gate(declared=None):
    shown = Shown()
    return ModelGate(FINGERPRINT, declared or {}, shown.metrics, transport="tcp"), shown


def test_nothing_is_known_before_an_engine_states_its_identity():
    g, shown = gate()
    assert g.identity is None and not g.known.is_set() and g.view() is None and shown.adopted() == []


def test_the_first_identity_is_adopted_and_the_same_one_is_welcome_again():
    g, shown = gate()
    assert g.offer(STAND_IN_IDENTITY.to_dict()) == ""
    assert g.offer(STAND_IN_IDENTITY.to_dict()) == ""  # a second DP rank, a re-attachment
    assert g.identity == STAND_IN_IDENTITY and g.known.is_set() and shown.adopted() == [STAND_IN_IDENTITY.digest]
    assert g.view()["digest"] == STAND_IN_IDENTITY.digest and shown.refusals() == 0


def test_an_engine_with_other_weights_is_refused_once_an_identity_is_adopted():
    g, shown = gate()
    g.offer(STAND_IN_IDENTITY.to_dict())
    why = g.offer(OTHER.to_dict())
    assert "another model identity" in why and "weights:" in why and "restart the pod" in why
    assert g.identity == STAND_IN_IDENTITY and shown.refusals() == 1


def test_an_engine_contradicting_the_configmap_is_refused_and_nothing_adopted():
    g, shown = gate({"revision": "abc123"})
    why = g.offer(STAND_IN_IDENTITY.to_dict())
    assert "contradicts the pool's ConfigMap (revision: <none> != abc123)" in why
    assert g.identity is None and shown.adopted() == [] and shown.refusals() == 1
    matching = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "revision": "abc123"})
    assert g.offer(matching.to_dict()) == "" and g.identity == matching


def test_a_malformed_identity_is_refused_without_a_traceback():
    g, shown = gate()
    assert "malformed" in g.offer({"weights": 1}) and "malformed" in g.offer("x")
    assert g.identity is None and shown.refusals() == 2


async def test_waiters_wake_when_the_identity_comes():
    g, shown = gate()
    waiter = asyncio.ensure_future(g.known.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    g.offer(STAND_IN_IDENTITY.to_dict())
    await asyncio.wait_for(waiter, 5)


def test_the_identity_of_an_engine_of_another_fingerprint_is_not_adopted():
    g, shown = gate()
    why = g.offer(STAND_IN_IDENTITY.to_dict(), "ffffffffffffffff")
    assert "fingerprint 'ffffffffffffffff' is not the pool's" in why
    assert g.identity is None and shown.adopted() == [] and shown.refusals() == 1
    assert g.offer(STAND_IN_IDENTITY.to_dict(), FINGERPRINT) == "" and g.identity == STAND_IN_IDENTITY
