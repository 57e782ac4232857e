"""Pool keys: key ids, admin tokens, choosing a shared key, re-reading rotated key files."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.peers.pool_keys import PoolKeys, admin_token, hkdf, key_id, load_optional_key

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


# Outputs of the hand-written HKDF that sessions were derived with before cryptography's HKDF took
# over (issue 42): a sidecar on either side of the change derives the same session keys.
PINNED_KEY = b"pool-key-0123456789abcdef"
PINNED_HKDF = [
    ((b"", b"", 32), "ce4bc463e760abb7d9b702355e11bb9001a804008e3a44650fc37453a0e436e3"),
    ((b"\x01" * 16 + b"\x02" * 16, b"kv-offload session v2\x00" + key_id(PINNED_KEY), 32),
     "082b48de2950016f6791c7d52f64c707c3e5077faebc7d6ab566a7c4417c4648"),
    ((b"salt", b"info", 100),
     "0540c23e20605bc314b716850ba928758b1bba9b3a1ca3858a906cda0d03a786988aded0fadd3d7e0d4c1dc9d25c65"
     "073d695ad660427105863d6b7cefb2cb0c00dc36c5932aa618dc59ca80d206cd089d3be4834be0e495e016e375c962"
     "7da1b17de4c6"),
]


@pytest.mark.parametrize(("args", "expected"), PINNED_HKDF)
def test_hkdf_gives_the_bytes_sessions_were_derived_with(args, expected):
    salt, info, length = args
    assert hkdf(PINNED_KEY, salt, info, length).hex() == expected


def test_a_session_key_is_the_one_derived_before_the_hkdf_change():
    from kv_offload_sidecar.peers.handshake import derive_session

    sid, skey = derive_session(PINNED_KEY, b"\x01" * 16, b"\x02" * 16, key_id(PINNED_KEY))
    assert (sid.hex(), skey.hex()) == ("719cb9bb807c93e36869f8b0dabd937c",
                                       "082b48de2950016f6791c7d52f64c707c3e5077faebc7d6ab566a7c4417c4648")
