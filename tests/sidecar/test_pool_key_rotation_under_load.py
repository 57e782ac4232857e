"""Pool-key rotation under load: a new key rolls out pod by pod, then the old one is removed.

Three sidecar processes, each with its own copy of the pool Secret (rewritten
atomically, as kubelet does, one pod at a time). While engines keep storing
chunks on one sidecar and loading them through another, the key changes twice
(new key + previous key, then previous removed). Nothing is lost: every chunk
that had reached the pool's directory loads, byte-identical, from the other
sidecar; no handshake is rejected; every link ends on the new key.
"""

from __future__ import annotations

import threading
import time

from kv_offload_sidecar.peers.pool_keys import admin_token, key_id
from kv_offload_tools.chaos.chunks import chunk_keys, load_and_verify, store_chunks
from kv_offload_testing.http_client import http_json
from kv_offload_testing.local_pool import DEFAULT_POOL_KEY, LocalPool
from waiting import SAFETY_SECONDS, wait_for

CHUNK = 16 * 1024
OLD = DEFAULT_POOL_KEY
NEW = b"rotated-pool-key-0123456789abcdef"
# Loads the test lets run before, during and after each step of the rotation.
LOADS_PER_STEP = 10


class Load(threading.Thread):
    """Stores 2 chunks per round on sidecar r % 3 and loads them through the next sidecar once
    that one's lookup finds them (they reached the pool's directory); ``drain`` loads the rest."""

    def __init__(self, pool: LocalPool) -> None:
        super().__init__(daemon=True)
        self.pool = pool
        self.stop = threading.Event()
        self.loaded = 0
        self.missed: list[str] = []
        self.corrupt = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        clients = [self.pool.client(i) for i in range(3)]
        pending: list[tuple[int, list[bytes]]] = []
        try:
            r = 0
            while not self.stop.is_set():
                owner = r % 3
                keys = chunk_keys(f"rotation/{r}", 2)
                assert store_chunks(clients[owner], keys, CHUNK) == 2
                pending.append((owner, keys))
                while pending and clients[(pending[0][0] + 1) % 3].lookup(pending[0][1]).peer == 2:
                    self._load(clients, *pending.pop(0))
                r += 1
                time.sleep(0.02)  # pacing: the stores stay far below the capacity
            # The rest: once the directory is current, every one of them is found and loads.
            self.pool.wait_directory_current()
            for holder, ks in pending:
                self._load(clients, holder, ks)
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            for c in clients:
                c.close()

    def _load(self, clients: list, holder: int, keys: list[bytes]) -> None:
        n, bad = load_and_verify(clients[(holder + 1) % 3], keys, CHUNK, timeout=3.0)
        self.loaded += n
        self.corrupt += bad
        if n != len(keys):
            self.missed.append(f"round keys of sidecar-{holder}: {n}/{len(keys)} at {time.strftime('%H:%M:%S')}")

    def run_loads(self, n: int) -> None:
        """Until ``n`` more chunks loaded (the load goes on meanwhile)."""
        target = self.loaded + n
        wait_for(f"{n} more loads under the rotation", lambda: self.loaded >= target or self.error is not None)


def link_keys(pool: LocalPool) -> set[str]:
    return {p["key_id"] for sc in pool.members() for p in sc.peers() if p["state"] == "connected"}


def test_rotating_the_pool_key_under_load_loses_nothing() -> None:
    with LocalPool(3, capacity_bytes=512 * CHUNK, fetch_deadline_seconds=3.0,
                   extra_args=("--key-reload-seconds", "0.2")) as pool:
        assert link_keys(pool) == {key_id(OLD).hex()}
        load = Load(pool)
        load.start()
        try:
            load.run_loads(LOADS_PER_STEP)
            for sc in pool.sidecars:  # phase 1: the new key rolls out, the old one stays accepted
                pool.write_keys(sc.identity, NEW, OLD)
                load.run_loads(LOADS_PER_STEP)
            wait_for("every link to re-key to the new key", lambda: link_keys(pool) == {key_id(NEW).hex()})
            load.run_loads(LOADS_PER_STEP)
            for sc in pool.sidecars:  # phase 2: the rotation is over, the old key goes
                pool.write_keys(sc.identity, NEW)
                load.run_loads(LOADS_PER_STEP)
            load.run_loads(LOADS_PER_STEP)
        finally:
            load.stop.set()
            load.join(SAFETY_SECONDS)
        assert not load.is_alive()
        assert load.error is None, load.error
        assert load.missed == [] and load.corrupt == 0
        assert link_keys(pool) == {key_id(NEW).hex()}
        for sc in pool.members():
            assert sc.metric("kv_offload_handshakes_total", result="rejected") == 0
            assert sc.metric("kv_offload_integrity_failures_total") == 0
            assert sc.metric("kv_offload_key_reloads_total") == 2
            assert len([p for p in sc.peers() if p["state"] == "connected"]) == 2
        # a peer that still holds only the old key is now refused
        intruder = pool.add(identity="stale-pod", peers=[pool[0].identity], wait_connected=False)
        wait_for("the stale pod's rejection",
                 lambda: pool[0].metric("kv_offload_handshakes_total", reason="other_pool") >= 1)
        assert all(p["state"] != "connected" for p in intruder.peers())
        # the admin token derived from the old key no longer opens the admin endpoints
        code, _ = pool[0].get("/v1/status", auth=False)
        assert code == 401
        assert http_json(pool[0].url + "/v1/status",
                         headers={"Authorization": f"Bearer {admin_token(OLD)}"})[0] == 401
        assert http_json(pool[0].url + "/v1/status",
                         headers={"Authorization": f"Bearer {admin_token(NEW)}"})[0] == 200
