"""Fixtures of the network-namespace tests: a bare PodNetwork and a NetnsPool of three pods.

Both fail, saying why and what to change (``host_rights.require``), where this process may
not make network namespaces (not root, not Linux, a container without CAP_SYS_ADMIN).
Teardown removes every namespace the fixture made (``PodNetwork.destroy`` fails the test when one is left).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_offload_tools.netns.ip import unavailable
from kv_offload_tools.netns.network import PodNetwork
from kv_offload_tools.netns.pool import NetnsPool
from host_rights import require


@pytest.fixture(scope="session")
def netns_permitted() -> None:
    require(unavailable())


@pytest.fixture(scope="module")
def net(netns_permitted: None) -> Iterator[PodNetwork]:
    """Three pod namespaces and their router, no processes; faults healed after each test."""
    network = PodNetwork().create(3)
    try:
        yield network
    finally:
        network.destroy()


@pytest.fixture
def clean_net(net: PodNetwork) -> Iterator[PodNetwork]:
    """``net`` with no partition or cap left by the test."""
    try:
        yield net
    finally:
        net.heal()
        for pod in net.pods:
            net.uncap(pod)


def _three_pods(transport: str = "tcp") -> Iterator[NetnsPool]:
    pool = NetnsPool(3, fetch_deadline_seconds=1.0, transport=transport).start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def netns_pool(netns_permitted: None) -> Iterator[NetnsPool]:
    """Three pods, one sidecar each (tcp, 16 KiB chunks), peers found by the pool name."""
    yield from _three_pods()


@pytest.fixture
def fresh_netns_pool(netns_permitted: None) -> Iterator[NetnsPool]:
    """``netns_pool`` made for one test: a test that cuts a pod leaves the next a pool that
    has not been cut (the directory's reconvergence after a heal under a loaded host is
    issue 48's open part; these tests are about liveness)."""
    yield from _three_pods()


@pytest.fixture(params=["tcp", "ucx"])
def fresh_netns_pool_each_plane(request: pytest.FixtureRequest, netns_permitted: None) -> Iterator[NetnsPool]:
    """``fresh_netns_pool`` once with each data plane whose open tells differently whether it
    reached the holder's host: tcp by its own connection, ucx by dialling the control port."""
    yield from _three_pods(request.param)
