"""SidecarSettings: one frozen group per what a user tunes together, built from flat keywords."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.setting_flags import flag_fields, leaf_fields
from kv_offload_sidecar.settings import GROUPS, RecomputeSettings, SidecarSettings


def test_every_setting_is_in_a_group_under_a_name_no_other_group_uses():
    grouped = leaf_fields(SidecarSettings)
    assert [f.name for group, f in grouped if group == ""] == []  # no setting outside a group
    assert list(dict.fromkeys(group for group, _ in grouped)) == [g.name for g in GROUPS]
    names = [f.name for _, f in grouped]
    assert len(names) == len(set(names))  # so a flag's dest and SidecarSettings.of's keywords are unambiguous
    assert [n for g in GROUPS for n in g.fields] == [f.name for f, _ in flag_fields(SidecarSettings)]


def test_settings_of_sorts_flat_keywords_into_their_groups(make_settings):
    s = make_settings(fetch_deadline_seconds=0.25, capacity_bytes=1 << 21, transport="tcp")
    assert (s.peers.fetch_deadline_seconds, s.store.capacity_bytes, s.data_plane.transport) == (0.25, 1 << 21, "tcp")
    assert s.recompute == RecomputeSettings()  # a group given nothing is at its defaults


def test_settings_of_names_an_unknown_keyword_and_each_group_checks_its_values(make_settings):
    with pytest.raises(TypeError, match="has no setting fetch_deadline"):
        make_settings(fetch_deadline=1.0)
    with pytest.raises(ValueError, match="capacity_bytes 0 must be positive"):
        make_settings(capacity_bytes=0)
    with pytest.raises(ValueError, match="pool_key is empty"):
        make_settings(pool_key=b"")


def test_settings_spanning_two_groups_are_checked_by_the_whole(make_settings):
    with pytest.raises(ValueError, match="TLS encrypts the tcp data plane only, but transport is 'ucx'"):
        make_settings(transport="ucx", tls_cert_file="c", tls_key_file="k", tls_ca_file="a")
