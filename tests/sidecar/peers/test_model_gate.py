"""ModelGate: a sidecar shares under the identity its engine gave it, and refuses others."""

from __future__ import annotations

import asyncio

from kv_offload_sidecar.engine.model_identity import ModelIdentity
from kv_offload_sidecar.peers.model_gate import ModelGate
from kv_offload_tools.sidecar_process import STAND_IN_IDENTITY

OTHER = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "weights": "files:9c1d000000000000"})


def gate(declared=None):
    adopted, refusals = [], []
    g = ModelGate(declared or {}, on_adopted=adopted.append, on_refused=lambda: refusals.append(1))
    return g, adopted, refusals


def test_nothing_is_known_before_an_engine_states_its_identity():
    g, adopted, _ = gate()
    assert g.identity is None and not g.known.is_set() and g.view() is None and adopted == []


def test_the_first_identity_is_adopted_and_the_same_one_is_welcome_again():
    g, adopted, refusals = gate()
    assert g.offer(STAND_IN_IDENTITY.to_dict()) == ""
    assert g.offer(STAND_IN_IDENTITY.to_dict()) == ""  # a second DP rank, a re-attachment
    assert g.identity == STAND_IN_IDENTITY and g.known.is_set() and adopted == [STAND_IN_IDENTITY]
    assert g.view()["digest"] == STAND_IN_IDENTITY.digest and refusals == []


def test_an_engine_with_other_weights_is_refused_once_an_identity_is_adopted():
    g, _, refusals = gate()
    g.offer(STAND_IN_IDENTITY.to_dict())
    why = g.offer(OTHER.to_dict())
    assert "another model identity" in why and "weights:" in why and "restart the pod" in why
    assert g.identity == STAND_IN_IDENTITY and refusals == [1]


def test_an_engine_contradicting_the_configmap_is_refused_and_nothing_adopted():
    g, adopted, refusals = gate({"revision": "abc123"})
    why = g.offer(STAND_IN_IDENTITY.to_dict())
    assert "contradicts the pool's ConfigMap (revision: <none> != abc123)" in why
    assert g.identity is None and adopted == [] and refusals == [1]
    matching = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "revision": "abc123"})
    assert g.offer(matching.to_dict()) == "" and g.identity == matching


def test_a_malformed_identity_is_refused_without_a_traceback():
    g, _, refusals = gate()
    assert "malformed" in g.offer({"weights": 1}) and "malformed" in g.offer("x")
    assert g.identity is None and refusals == [1, 1]


async def test_waiters_wake_when_the_identity_comes():
    g, _, _ = gate()
    waiter = asyncio.ensure_future(g.known.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    g.offer(STAND_IN_IDENTITY.to_dict())
    await asyncio.wait_for(waiter, 5)
