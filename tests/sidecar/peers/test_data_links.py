"""Data links on demand, with sidecars in this process: a member holds no data connection
until an exchange needs one, an idle one closes (on both ends), at most ``max_open`` are open,
and a member with none that fails a location call is dropped."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.peers import links
from kv_offload_sidecar.peers.links import PeerLink
from kv_offload_sidecar.sidecar import Sidecar
from kv_offload_tools.chaos.chunks import chunk_keys
from sidecar_support import identified, settled, store_zeros
from waiting import wait_for_async

# Fetch deadline of these tests: an anti-hang bound (a busy machine may answer late).
REQUEST_DEADLINE_SECONDS = 30.0


def _pool(make_settings, *holders: str) -> tuple[list[Sidecar], Sidecar]:
    """Sidecars named ``holders`` (each linked to those before it) and an "asker" linked to each."""
    settings: list = []
    for name in holders:
        settings.append(make_settings(identity=name, static_peers=tuple(
            f"127.0.0.1:{s.network.base_port}" for s in settings)))
    peers = tuple(f"127.0.0.1:{s.network.base_port}" for s in settings)
    return [identified(Sidecar(s)) for s in settings], identified(Sidecar(
        make_settings(identity="asker", static_peers=peers)))


async def _read(asker: Sidecar, keys: list[bytes]) -> None:
    """A lookup and its load: every key is a peer hit."""
    assert await asker.lookup(keys, REQUEST_DEADLINE_SECONDS) == (0, len(keys))
    pins = await asker.load(keys, REQUEST_DEADLINE_SECONDS)
    assert [p.key for p in pins] == keys
    for p in pins:
        p.release()


def _gauge(sidecar: Sidecar, name: str) -> float:
    return getattr(sidecar.metrics, name)._value.get()


async def test_a_member_has_no_data_connection_until_its_first_exchange_which_still_hits(make_settings):
    (holder,), asker = _pool(make_settings, "holder")
    async with running(holder), running(asker):
        keys = chunk_keys("on-demand", 4)
        store_zeros(holder, keys)
        await settled(holder, asker)
        link = asker.peers.connected("holder")
        assert link is not None and link.member and link.data is None
        assert asker.status()["data_links"]["open"] == 0 and asker.status()["data_lanes"] == {}
        assert holder.data_server.authenticated_connections == 0
        await _read(asker, keys)  # the data link opens within the request: a hit, not a miss
        assert link.data is not None and asker.status()["data_links"]["open"] == 1
        assert _gauge(asker, "peer_data_links") == 1
        view, = (p for p in asker.peers_view() if p["identity"] == "holder")
        assert view["data_open"] and view["data_lanes"] == asker.status()["data_lanes"]["holder"] >= 1


async def test_an_idle_data_link_closes_on_both_ends_and_the_peer_stays_a_member(make_settings):
    (holder,), asker = _pool(make_settings, "holder")
    asker.peers.data_links.idle_seconds = 0.5
    async with running(holder), running(asker):
        keys = chunk_keys("idle", 3)
        store_zeros(holder, keys)
        await settled(holder, asker)
        await _read(asker, keys)
        link = asker.peers.connected("holder")
        assert link is not None and link.data is not None
        await wait_for_async("the idle data link closed", lambda: link.data is None)
        assert link.state == "connected" and link.member and _gauge(asker, "peer_data_links") == 0
        # The holder's server saw the client close its side (EOF), not its silence rule (5 s).
        await wait_for_async("the holder's side of it closed",
                             lambda: holder.data_server.authenticated_connections == 0)
        again = chunk_keys("idle-again", 2)
        store_zeros(holder, again)
        await settled(holder, asker)
        await _read(asker, again)  # opened again on demand
        assert asker.peers.data_links.opened == 2


async def test_past_the_bound_a_new_data_link_closes_the_least_recently_used_idle_one(make_settings):
    (a, b), asker = _pool(make_settings, "a", "b")
    asker.peers.data_links.max_open = 1
    async with running(a), running(b), running(asker):
        at_a, at_b = chunk_keys("at-a", 3), chunk_keys("at-b", 3)
        store_zeros(a, at_a)
        store_zeros(b, at_b)
        await settled(a, b, asker)
        link_a, link_b = asker.peers.connected("a"), asker.peers.connected("b")
        await _read(asker, at_a)
        assert link_a.data is not None and link_b.data is None
        await _read(asker, at_b)  # a's link is idle: it closes for b's
        assert link_a.data is None and link_b.data is not None
        assert asker.peers.data_links.count() == 1 and link_a.member and link_a.state == "connected"
        await wait_for_async("a's side of the closed link closed", lambda: a.data_server.authenticated_connections == 0)


@asynccontextmanager
async def _holder_gone(make_settings) -> AsyncIterator[tuple[Sidecar, PeerLink]]:
    """An asker and its link to the member "holder": connected with no data link, then the holder stopped."""
    (holder,), asker = _pool(make_settings, "holder")
    async with running(asker):
        async with running(holder):
            await settled(holder, asker)
            link = asker.peers.connected("holder")
            assert link is not None and link.data is None
        yield asker, link


async def test_a_member_gone_with_no_data_link_is_dropped_after_a_failed_location_call(make_settings):
    async with _holder_gone(make_settings) as (asker, link):
        # The holder is gone; no heartbeat watches it (no data link), so nothing noticed yet.
        assert asker.location.status()["members"] == 2
        try:
            await asker.peers.call("holder", "locate", {"digests": []}, 1.0)
        except (ConnectionError, TimeoutError):
            pass
        else:
            raise AssertionError("a location call to a stopped peer answered")
        await wait_for_async("the gone member dropped",
                             lambda: asker.location.status()["members"] == 1 and not link.member)
        assert link.state in ("backoff", "connecting") and asker.peers.connected("holder") is None


async def test_a_member_gone_with_no_data_link_and_no_messages_is_dropped_by_its_probe(make_settings, caplog):
    caplog.set_level(logging.INFO, logger=links.__name__)
    async with _holder_gone(make_settings) as (asker, link):
        # Nothing is sent to it: within MEMBER_PROBE_SECONDS of the last word from it, a probe
        # (one locate) finds it gone.
        await wait_for_async("the gone member dropped by its probe",
                             lambda: asker.location.status()["members"] == 1 and not link.member)
        # Lost for the probe's failed locate, as logged then: by now the link's first reconnect
        # may have failed too and put its own error in last_error (seen under a busy core).
        lost = [r.getMessage() for r in caplog.records if " lost: " in r.getMessage()]
        assert lost and "lost: locate" in lost[0], lost


async def test_a_holder_serving_its_most_readers_is_a_miss_for_one_more_not_a_lost_peer(make_settings):
    (holder, reader), asker = _pool(make_settings, "holder", "reader")
    async with running(holder), running(reader), running(asker):
        holder.data_server._proven.max_sessions = 1  # serves one reader at a time (64 by default)
        keys = chunk_keys("busy-holder", 3)
        store_zeros(holder, keys)
        await settled(holder, reader, asker)
        await _read(reader, keys)  # the reader's data link holds the holder's one place
        assert await asker.lookup(keys, REQUEST_DEADLINE_SECONDS) == (0, 0)  # refused as busy: a miss
        link = asker.peers.connected("holder")
        assert link is not None and link.member and link.failures == 0 and link.data is None
        reader.peers.data_links.close(reader.peers.connected("holder"))  # the reader's link went idle
        await wait_for_async("the holder's place freed", lambda: holder.data_server.authenticated_connections == 0)
        await _read(asker, keys)
