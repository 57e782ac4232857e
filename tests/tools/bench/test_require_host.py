"""A bench refuses to run where the host lacks what it needs, naming the bench and the reason."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.usage import UsageError
from kv_offload_tools.bench import require_host


def test_a_host_with_what_the_bench_needs_passes() -> None:
    require_host("netns", None)


def test_a_host_without_it_is_refused_naming_the_bench_and_why() -> None:
    with pytest.raises(UsageError, match=r"^kv-offload bench restarts: mounting a tmpfs needs root$"):
        require_host("restarts", "mounting a tmpfs needs root")
