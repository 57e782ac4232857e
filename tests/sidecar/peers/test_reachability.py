"""A peer that reaches us but that we cannot dial back is counted as unreachable."""

from __future__ import annotations

from kv_offload_sidecar.peers.links import PeerLink
from kv_offload_sidecar.peers.reachability import unreachable


def link(address: str, identity: str | None, state: str, failures: int) -> PeerLink:
    return PeerLink(address, state=state, identity=identity, failures=failures)


def test_only_failing_links_to_peers_that_dialled_us_count():
    links = [link("10.0.0.1:5710", "b", "connecting", 3),  # dialled us, our attempts fail
             link("10.0.0.2:5710", None, "backoff", 1),  # never connected; its hello named this address
             link("10.0.0.3:5710", "c", "connected", 0),
             link("10.0.0.4:5710", "d", "backoff", 2),  # down, but it never reached us either
             link("10.0.0.5:5710", "e", "connecting", 0)]  # a first attempt
    inbound = {("b", "10.0.0.1:5710"), ("x", "10.0.0.2:5710"), ("c", "10.0.0.3:5710"), ("e", "10.0.0.5:5710")}
    assert unreachable(links, inbound) == ["10.0.0.2:5710", "b"]
