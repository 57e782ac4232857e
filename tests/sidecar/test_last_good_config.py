"""A bad edit of the pool's config never takes a running pod's sidecar down: it keeps its last good one."""

from __future__ import annotations

import json
import logging
import os

import pytest
from kv_offload_sidecar import last_good_config
from kv_offload_sidecar.last_good_config import IN_POD_ENV
from kv_offload_sidecar.engine.client import LookupReply
from kv_offload_testing.local_pool import LocalPool, example_config

CHUNK = example_config().kv_bytes_per_chunk
REJECTED = "kv_offload_config_rejected"


def config_document(**changes: object) -> dict:
    return {**example_config().to_dict(), "model_identity": {"revision": "abc"}, **changes}


def hand_edit(document: dict) -> dict:
    """The ConfigMap after a bad hand edit: a number written as a word."""
    return {**document, "cache": {**document["cache"], "tokens_per_hash": "sixteen"}}


def write(path, document: dict) -> None:
    with open(path, "w") as fh:
        json.dump(document, fh)


def test_a_restart_on_a_bad_config_runs_the_saved_one_and_names_the_key_and_value(tmp_path, caplog):
    config, saved = tmp_path / "offloading_config.json", str(tmp_path / "saved.json")
    write(config, config_document())
    good = last_good_config.load(str(config), saved=saved)
    assert (good.rejected, good.declared) == ("", {"revision": "abc"})
    last_good_config.keep(saved, good.config, good.declared)
    write(config, hand_edit(config_document()))
    with caplog.at_level(logging.WARNING, logger="kv_offload_sidecar"):
        kept = last_good_config.load(str(config), saved=saved)
    assert kept.config == good.config and kept.declared == good.declared
    assert "'tokens_per_hash' must be an integer, got 'sixteen'" in kept.rejected
    [line] = [r.getMessage() for r in caplog.records]
    assert "config rejected" in line and "tokens_per_hash" in line and good.config.fingerprint in line
    assert last_good_config.config_view(kept.rejected) == {"source": "last_good", "rejected": kept.rejected}


def test_a_first_start_on_a_bad_config_still_fails_naming_the_key(tmp_path):
    config = tmp_path / "offloading_config.json"
    write(config, hand_edit(config_document()))
    for saved in (None, str(tmp_path / "none-saved.json")):
        with pytest.raises(ValueError, match="'tokens_per_hash' must be an integer, got 'sixteen'"):
            last_good_config.load(str(config), saved=saved)


def test_a_saved_config_that_does_not_load_either_fails_naming_both(tmp_path):
    config, saved = tmp_path / "offloading_config.json", tmp_path / "saved.json"
    write(config, hand_edit(config_document()))
    saved.write_text("{")
    with pytest.raises(ValueError, match="tokens_per_hash.*last good config does not load either"):
        last_good_config.load(str(config), saved=str(saved))


def test_a_good_file_wins_over_the_saved_one_even_with_another_fingerprint(tmp_path):
    config, saved = tmp_path / "offloading_config.json", str(tmp_path / "saved.json")
    last_good_config.keep(saved, example_config(), {})
    other = example_config(model="other/model")
    write(config, other.to_dict())
    assert last_good_config.load(str(config), saved=saved).config == other


def test_keys_this_release_does_not_know_are_ignored_with_one_warning(tmp_path, caplog):
    config = tmp_path / "offloading_config.json"
    write(config, config_document(newer_operator_field={"x": 1}))
    with caplog.at_level(logging.WARNING, logger="kv_offload_sidecar"):
        loaded = last_good_config.load(str(config), saved=None)
    assert loaded.config == example_config() and loaded.unknown == ("newer_operator_field",)
    [line] = [r.getMessage() for r in caplog.records]
    assert "newer_operator_field" in line and "does not know" in line
    assert last_good_config.unknown_keys(config_document()) == ()  # what the operator writes today


def test_a_killed_sidecar_restarted_on_a_bad_config_serves_on_its_last_good_one_and_says_so():
    with LocalPool(1, transport="tcp", capacity_bytes=16 * CHUNK) as pool:
        sc = pool[0]
        config = sc.argv[sc.argv.index("--config") + 1]
        before = sc.status()
        assert before["config"] == {"source": "file", "rejected": ""} and sc.metric(REJECTED) == 0
        with open(config) as fh:
            good = json.load(fh)
        write(config, hand_edit(good))  # the ConfigMap, hand-edited, reaches the pod
        pool.restart(0, kill=True)  # an OOM kill or crash meanwhile
        status = sc.status()
        assert status["config"]["source"] == "last_good"
        assert "'tokens_per_hash' must be an integer, got 'sixteen'" in status["config"]["rejected"]
        assert status["fingerprint"] == before["fingerprint"] and sc.metric(REJECTED) == 1
        assert "config rejected" in sc.log_tail(200)
        client = sc.client()  # it serves: its engine stores and loads
        keys = [os.urandom(32) + bytes(4) for _ in range(3)]
        data = {k: os.urandom(client.slot_bytes) for k in keys}
        assert client.store(keys, lambda i, view: view.__setitem__(slice(None), data[keys[i]])) == 3
        assert client.lookup(keys) == LookupReply(local=3, peer=0)
        out: dict[int, bytes] = {}
        assert client.load(keys, lambda i, view: out.__setitem__(i, bytes(view)), 5.0) == 3
        assert [out[i] for i in range(3)] == [data[k] for k in keys]
        client.close()
        write(config, good)  # the operator reverted the edit
        pool.restart(0)
        assert sc.status()["config"] == {"source": "file", "rejected": ""} and sc.metric(REJECTED) == 0
        # a clean stop forgets the saved config: the next start on a bad file fails as a first start
        assert sc.terminate() == 0
        write(config, hand_edit(good))
        with pytest.raises(RuntimeError, match="exited with code 2"):
            sc.start()
        assert "tokens_per_hash" in sc.log_tail(5)
        # in a pod a clean stop (a liveness probe's SIGTERM) keeps it: the restart falls back
        write(config, good)
        sc.env[IN_POD_ENV] = "10.96.0.1"
        sc.start()
        assert sc.status()["config"]["source"] == "file"
        assert sc.terminate() == 0
        write(config, hand_edit(good))
        sc.start()
        assert sc.status()["config"]["source"] == "last_good" and sc.metric(REJECTED) == 1
        assert sc.terminate() == 0
        del sc.env[IN_POD_ENV]  # the pool's clean stop, off a pod, leaves no file behind
        sc.start()


def test_a_clean_stop_keeps_the_saved_config_in_a_pod_and_removes_it_elsewhere(tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text("{}")
    last_good_config.forget(str(saved), {IN_POD_ENV: "10.96.0.1"})
    assert saved.exists()
    last_good_config.forget(str(saved), {})
    assert not saved.exists()
