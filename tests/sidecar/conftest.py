"""Fixtures of the sidecar tests: in-process sidecar settings."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kv_offload_sidecar.settings import SidecarSettings
from kv_offload_testing.local_pool import example_config, free_port_block

POOL_KEY = b"test-pool-key"


@pytest.fixture
def make_settings(shm_dir: str) -> Callable[..., SidecarSettings]:
    """SidecarSettings for an in-process sidecar on 127.0.0.1 (tcp data plane, free ports);
    ``changes`` name settings flat (``identity=...``), ``SidecarSettings.of`` finds their groups."""

    def build(**changes: object) -> SidecarSettings:
        fields: dict[str, object] = dict(
            config=example_config(), pool_key=POOL_KEY, host="127.0.0.1",
            base_port=free_port_block(1), dp_indices=(0,), data_port=0, capacity_bytes=1 << 20,
            transport="tcp", shm_dir=shm_dir, identity="test-sidecar",
            publish_interval_seconds=0.1, fetch_deadline_seconds=1.0, shutdown_grace_seconds=0.5)
        fields.update(changes)
        return SidecarSettings.of(**fields)  # one keyword per setting, whatever its group

    return build


@pytest.fixture
def files(tmp_path) -> tuple[str, str]:
    """(config file, pool key file) of a `kv-offload sidecar` command line (the key: ``k3y``)."""
    config = tmp_path / "offloading_config.json"
    config.write_text(example_config().to_json())
    key = tmp_path / "pool.key"
    key.write_bytes(b"k3y\n")
    return str(config), str(key)
