"""Discovery: static lists, DNS re-resolution with joins and leaves, own addresses excluded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from kv_offload_sidecar.peers.discovery import FORGET_AFTER_FAILURES, Discovery, parse_peer, parse_peer_list
from waiting import SAFETY_SECONDS


def test_parse_peer_accepts_host_port_and_bracketed_ipv6():
    assert parse_peer("10.0.0.7:5710") == ("10.0.0.7", 5710)
    assert parse_peer("[::1]:5711") == ("::1", 5711)
    assert parse_peer_list("a:1, b:2,,a:1") == ("a:1", "b:2")
    assert parse_peer_list(["::1:5710"]) == ("[::1]:5710",)


@pytest.mark.parametrize("bad", ["nohost", "host:", ":5710", "host:port", "host:0", "host:70000"])
def test_parse_peer_rejects_with_example(bad):
    with pytest.raises(ValueError, match="host:port|outside"):
        parse_peer(bad)


def test_static_peers_exclude_own_addresses():
    d = Discovery(static_peers=["127.0.0.1:5710", "127.0.0.1:5711"], own_addresses=["127.0.0.1:5710"])
    assert d.current() == {"127.0.0.1:5711"}


async def test_dns_name_resolves_through_the_system_resolver():
    d = Discovery(dns_name="localhost", base_port=6000, dp_size=2)
    found = await d.resolve_once()
    assert "127.0.0.1:6000" in found and "127.0.0.1:6001" in found


async def test_dns_peers_join_and_leave_between_resolutions():
    answers = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]]

    async def resolver(name: str) -> list[str]:
        assert name == "pool.ns.svc"
        return answers.pop(0)

    d = Discovery(dns_name="pool.ns.svc", base_port=5710, resolver=resolver, interval_seconds=0.01)
    await d.resolve_once()
    assert d.current() == {"10.0.0.1:5710"}
    await d.resolve_once()
    assert d.current() == {"10.0.0.1:5710", "10.0.0.2:5710"}
    await d.resolve_once()
    assert d.current() == {"10.0.0.2:5710"}


async def test_failed_resolution_keeps_the_last_answer():
    calls = 0

    async def resolver(name: str) -> list[str]:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError("temporary failure in name resolution")
        return ["10.0.0.9"]

    d = Discovery(dns_name="pool", resolver=resolver)
    await d.resolve_once()
    await d.resolve_once()
    assert d.current() == {"10.0.0.9:5710"}


async def test_background_run_picks_up_changes_and_signals_them():
    answers = iter([["10.0.0.1"], ["10.0.0.3"]])

    async def resolver(name: str) -> list[str]:
        return next(answers, ["10.0.0.3"])

    d = Discovery(dns_name="pool", resolver=resolver, interval_seconds=0.01)
    task = asyncio.create_task(d.run())
    try:
        seen = []
        while d.current() != {"10.0.0.3:5710"}:  # each change is signalled until the last answer holds
            assert await d.wait_changed(SAFETY_SECONDS), f"no change signalled; peers {d.current()}"
            seen.append(d.current())
        assert seen and seen[-1] == {"10.0.0.3:5710"}  # the run signalled the change it made
    finally:
        task.cancel()


async def test_dynamic_peers_are_added_once_and_removable():
    d = Discovery(static_peers=["h:1"], own_addresses=["me:1"])
    d.add_dynamic("h:1")
    d.add_dynamic("me:1")
    d.add_dynamic("g:2")
    d.add_dynamic("garbage")
    assert d.current() == {"h:1", "g:2"}
    d.remove_dynamic("g:2")
    assert d.current() == {"h:1"}


def test_learnt_peers_are_forgotten_once_unreachable_or_refusing_our_proof_but_static_ones_stay():
    d = Discovery(static_peers=["10.0.0.1:5710"])
    for addr in ("10.0.0.2:5710", "10.0.0.3:5710", "10.0.0.4:5710"):
        d.add_dynamic(addr)
    links = [SimpleNamespace(address="10.0.0.1:5710", state="backoff", failures=99, last_error=""),
             SimpleNamespace(address="10.0.0.2:5710", state="backoff", failures=FORGET_AFTER_FAILURES,
                             last_error="ConnectError"),
             SimpleNamespace(address="10.0.0.3:5710", state="rejected", failures=1,
                             last_error="peer rejected us: handshake rejected (other_pool): ..."),
             SimpleNamespace(address="10.0.0.4:5710", state="backoff", failures=FORGET_AFTER_FAILURES - 1,
                             last_error="ConnectError")]
    assert sorted(d.forget_unreachable(links)) == ["10.0.0.2:5710", "10.0.0.3:5710"]
    assert d.current() == {"10.0.0.1:5710", "10.0.0.4:5710"}
