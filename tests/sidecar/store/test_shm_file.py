"""A store file made again where a previous one is still mapped: on a volume that holds
one store, the new one waits for the old pages to be let go, bounded, and says so."""

from __future__ import annotations

import logging
import mmap
import os
import threading

import pytest
from kv_offload_sidecar.store import shm_file
from kv_offload_sidecar.store.shm_file import create_mapping
from kv_offload_tools.shm_restarts import bounded_tmpfs, tmpfs_unavailable
from waiting import wait_for
from host_rights import require

STORE = 8 << 20


@pytest.fixture
def one_store_volume():
    """A tmpfs that holds one store and 1 MiB more."""
    require(tmpfs_unavailable())
    with bounded_tmpfs(STORE + (1 << 20)) as path:
        yield path


def test_a_new_store_waits_for_the_mapped_leftover_to_be_let_go(one_store_volume, caplog):
    caplog.set_level(logging.WARNING, logger=shm_file.__name__)
    path = shm_file.store_file_path(one_store_volume, "s")
    old = create_mapping(path, STORE, replace_existing=False)  # what the tier still maps
    made: list[mmap.mmap] = []
    maker = threading.Thread(target=lambda: made.append(create_mapping(path, STORE, True)))
    maker.start()
    wait_for("the new store to say it waits for the old one",
             lambda: any("waiting for vLLM's tier to let go" in r.getMessage() for r in caplog.records))
    assert not made
    old.close()  # the tier lets go
    maker.join(timeout=30)
    assert made and len(made[0]) == STORE
    assert os.stat(path).st_blocks * 512 >= STORE
    made[0].close()


def test_a_leftover_nobody_lets_go_fails_after_the_bounded_wait(one_store_volume, monkeypatch):
    monkeypatch.setattr(shm_file, "RECLAIM_WAIT_SECONDS", 0.3)
    path = shm_file.store_file_path(one_store_volume, "s")
    old = create_mapping(path, STORE, replace_existing=False)
    try:
        with pytest.raises(ValueError, match="after waiting 0 s for the previous store file's"):
            create_mapping(path, STORE, replace_existing=True)
        assert not os.path.exists(path)  # the new file is gone again
    finally:
        old.close()


def test_a_volume_too_small_even_without_the_leftover_fails_at_once(one_store_volume, monkeypatch):
    monkeypatch.setattr(shm_file, "RECLAIM_WAIT_SECONDS", 3600.0)  # never waited for
    path = shm_file.store_file_path(one_store_volume, "s")
    with pytest.raises(ValueError, match=r"capacity_bytes needs \d+ bytes .* but only \d+ are free; "):
        create_mapping(path, 2 * STORE, replace_existing=True)
