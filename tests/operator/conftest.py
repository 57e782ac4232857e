"""Fixtures of the operator tests that run the operator against kmock's emulated API server."""

from __future__ import annotations

from collections.abc import Iterator

import kmock
import pytest
from operator_harness import assert_within_rbac, emulate_cluster


@pytest.fixture
def cluster_within_rbac(kmock: kmock.KubernetesEmulator) -> Iterator[kmock.KubernetesEmulator]:
    """kmock's API server showing the kinds the operator uses; after the test, every request the
    operator made must be one the chart's RBAC grants."""
    emulate_cluster(kmock)
    yield kmock
    assert_within_rbac(kmock)
