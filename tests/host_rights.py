"""What ``./dev test`` needs of its host, and the one way a test says it lacks it.

Bounded ``/dev/shm`` (a size-bounded tmpfs) and pods on a network (network
namespaces, veth pairs, ``tc``) are what a cluster has and one host does not; the
tests that show them need root on Linux, as CI has. Where the host cannot, they fail
naming what is missing and what to change, never skip: a skipped test would hide
that restarts on a bounded ``/dev/shm`` or faults between pods went untested.
"""

from __future__ import annotations

import pytest

# What to change when a test finds its host lacking.
HOW_TO_RUN = "run ./dev test as root on Linux (as CI does; see CONTRIBUTING.md)"


def require(reason: str | None) -> None:
    """Fail the calling test when ``reason`` says why this host cannot run it."""
    if reason:
        pytest.fail(f"{reason}: this test shows what a cluster has and needs it; {HOW_TO_RUN}",
                    pytrace=False)
