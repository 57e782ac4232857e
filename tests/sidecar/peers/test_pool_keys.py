"""Pool keys: key ids, admin tokens, choosing a shared key, re-reading rotated key files."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.peers.pool_keys import PoolKeys, admin_token, key_id, load_optional_key

OLD, NEW = b"old-pool-key-0123456789", b"new-pool-key-0123456789"


def test_key_id_names_a_key_without_revealing_it():
    assert key_id(OLD) != key_id(NEW) and len(key_id(OLD)) == 8
    assert OLD not in key_id(OLD) and key_id(OLD) == key_id(OLD)


def test_responder_prefers_its_current_key_when_the_initiator_holds_it():
    keys = PoolKeys(NEW, OLD)
    assert keys.choose([key_id(OLD), key_id(NEW)]) == key_id(NEW)
    assert keys.choose([key_id(OLD)]) == key_id(OLD)
    assert PoolKeys(OLD).choose([key_id(NEW), key_id(OLD)]) == key_id(OLD)
    assert PoolKeys(OLD).choose([key_id(NEW)]) is None


def test_admin_tokens_are_derived_from_either_key_or_given():
    keys = PoolKeys(NEW, OLD, b"ops-token")
    assert keys.admin_allowed(admin_token(NEW)) and keys.admin_allowed(admin_token(OLD))
    assert keys.admin_allowed("ops-token")
    assert not keys.admin_allowed("") and not keys.admin_allowed(admin_token(b"another-key"))
    assert not PoolKeys(NEW).admin_allowed(admin_token(OLD))


def test_reload_follows_a_rotation_and_reports_retired_keys(tmp_path):
    cur, prev = tmp_path / "key", tmp_path / "previous-key"
    cur.write_bytes(OLD)
    keys = PoolKeys(OLD, current_file=str(cur), previous_file=str(prev))
    assert keys.reload() == []
    cur.write_bytes(NEW + b"\n")
    prev.write_bytes(OLD)
    assert keys.reload() == []
    assert keys.offered_ids() == [key_id(NEW), key_id(OLD)]
    prev.unlink()
    assert keys.reload() == [key_id(OLD)]
    assert keys.offered_ids() == [key_id(NEW)] and not keys.holds(key_id(OLD))


def test_a_vanished_current_key_file_keeps_the_key_in_use(tmp_path):
    cur = tmp_path / "key"
    cur.write_bytes(OLD)
    keys = PoolKeys(OLD, current_file=str(cur))
    cur.unlink()
    assert keys.reload() == [] and keys.current == OLD


def test_optional_key_files(tmp_path):
    assert load_optional_key("") == b"" and load_optional_key(str(tmp_path / "absent")) == b""
    (tmp_path / "k").write_bytes(b" x \n")
    assert load_optional_key(str(tmp_path / "k")) == b"x"
    with pytest.raises(ValueError, match="unreadable"):
        load_optional_key(str(tmp_path))


def test_an_empty_pool_key_is_refused_with_the_flag_to_fix():
    with pytest.raises(ValueError, match="--pool-key-file"):
        PoolKeys(b"")
