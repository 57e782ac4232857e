"""The engine path's peer side, with two sidecars in this process: locate, one exchange, demotion."""

from __future__ import annotations

import asyncio
import hashlib

from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.sidecar import Sidecar


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest()[:16] + bytes(4) for i in range(n)]


def _store(sidecar: Sidecar, keys: list[bytes]) -> None:
    for r in sidecar.reserve(keys):
        assert r is not None
        r.view[:] = bytes(len(r.view))
        r.commit()


async def _settled(*sidecars: Sidecar) -> None:
    for _ in range(100):
        views = [s.location.status() for s in sidecars]
        if all(v["pending"] == 0 and v["members"] == len(sidecars) for v in views) and \
                sum(v["entries"] for v in views) == sum(v["keys"] for v in views):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the directory did not settle: {[s.location.status() for s in sidecars]}")


async def test_a_lookup_fetches_its_hits_and_the_load_demotes_them(make_settings):
    holder_settings = make_settings(identity="holder")
    holder = Sidecar(holder_settings)
    asker = Sidecar(make_settings(identity="asker", static_peers=(f"127.0.0.1:{holder_settings.base_port}",)))
    async with running(holder), running(asker):
        keys, mine = _keys("chain", 6), _keys("own", 4)
        _store(holder, keys)
        _store(asker, mine)
        await _settled(holder, asker)
        # The admin lookup only counts: nothing moves.
        assert await asker.lookup(keys, 1.0, fetch=False) == (0, 6)
        assert len(asker.store) == 4
        before = asker.metrics.lookup_messages._value.get()
        assert await asker.lookup(keys, 1.0) == (0, 6)  # the engine's: the chunks start coming
        pins = await asker.load(keys, 1.0)
        assert [p.key for p in pins] == keys
        for p in pins:
            p.release()
        owner_remote = asker.location.owner_of(keys[0]) != "asker"
        assert asker.metrics.lookup_messages._value.get() - before == 1 + owner_remote
        # Loaded copies go to the cold end (the last one coldest), the asker's own chunks stay.
        order = list(asker.store._visible)
        assert order[:6] == list(reversed(keys)) and set(order[6:]) == set(mine)
        # A second lookup finds them here.
        assert await asker.lookup(keys, 1.0) == (6, 0)


async def test_a_holder_named_for_a_chunk_it_lost_is_one_false_claim_and_a_miss(make_settings):
    holder_settings = make_settings(identity="holder")
    holder = Sidecar(holder_settings)
    asker = Sidecar(make_settings(identity="asker", static_peers=(f"127.0.0.1:{holder_settings.base_port}",)))
    async with running(holder), running(asker):
        keys = _keys("stale", 3)
        for k in keys:  # published as held, never stored: what an owner names before an eviction is heard
            holder.location.record(k, True)
        for _ in range(100):
            if len(holder.location.directory) + len(asker.location.directory) == 3:
                break
            await asyncio.sleep(0.05)
        assert await asker.lookup(keys, 1.0) == (0, 0)
        assert await asker.load(keys, 1.0) == []
        assert asker.metrics.peer_false_claims._value.get() >= 1
        assert len(asker.store) == 0
