"""What sidecar tests in several folders share: chunks through an engine client, a peer's hello,
a clock the test moves, and the wait for in-process sidecars to form a pool.

A named module rather than conftest.py: pytest puts every test folder on sys.path, so
``from conftest import ...`` could resolve to another folder's conftest.
"""

from __future__ import annotations

import os

from kv_offload_sidecar.engine.client import EngineClient
from kv_offload_sidecar.peers.handshake import HelloMessage, make_hello
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.sidecar import Sidecar
from kv_offload_testing.local_pool import example_config
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY
from waiting import wait_for_async

# ------------------------------------------------------------------ chunks through an engine client


def new_keys(n: int) -> list[bytes]:
    """``n`` random vLLM-shaped keys (32-byte hash, 4-byte group index): none is stored yet."""
    return [os.urandom(32) + (0).to_bytes(4, "big") for _ in range(n)]


def write_chunks(client: EngineClient, keys: list[bytes]) -> dict[bytes, bytes]:
    """Store random bytes under every key (all must be stored); the bytes, by key."""
    data = {k: os.urandom(client.slot_bytes) for k in keys}

    def write(i: int, view: memoryview) -> None:
        view[:] = data[keys[i]]

    assert client.store(keys, write) == len(keys)
    return data


def read_chunks(client: EngineClient, keys: list[bytes], timeout: float = 5.0) -> list[bytes]:
    """The bytes of the leading run of ``keys`` the client could load (``timeout`` bounds a hang)."""
    out: dict[int, bytes] = {}

    def read(i: int, view: memoryview) -> None:
        out[i] = bytes(view)

    n = client.load(keys, read, timeout)
    return [out[i] for i in range(n)]


# ------------------------------------------------------------------ peers


def peer_hello(config: OffloadingConfig | None = None, **changes: object) -> HelloMessage:
    """The hello of a pool member "peer-x" running ``config`` (the example config by default)."""
    cfg = config or example_config()
    fields: dict[str, object] = dict(
        fingerprint=cfg.fingerprint, hash_seed="0", kv_bytes_per_chunk=cfg.kv_bytes_per_chunk,
        identity="peer-x", control_address="127.0.0.1:1", data_address="tcp://127.0.0.1:2",
        transport="tcp", run_config=cfg.run_config(), model_identity=STAND_IN_IDENTITY)
    fields.update(changes)
    return make_hello(**fields)  # type: ignore[arg-type]


class Clock:
    """A monotonic clock the test moves (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store_zeros(sidecar: Sidecar, keys: list[bytes]) -> None:
    """Store ``keys`` in ``sidecar`` straight through its store (chunks of zeros)."""
    for r in sidecar.reserve(keys):
        assert r is not None
        r.view[:] = bytes(len(r.view))
        r.commit()


async def settled(*sidecars: Sidecar) -> None:
    """Until every sidecar is a member of every view (links up) and the chunks recorded anywhere
    are in their owners' directories."""

    def formed() -> bool:
        views = [s.location.status() for s in sidecars]
        return all(v["pending"] == 0 and v["members"] == len(sidecars) for v in views) and \
            sum(v["entries"] for v in views) == sum(v["keys"] * v["owners_per_chunk"] for v in views)

    await wait_for_async(f"the directory settled ({[s.location.status() for s in sidecars]} at the start)",
                         formed)


def identified(sidecar: Sidecar) -> Sidecar:
    """``sidecar`` after a stand-in engine stated its model identity (it shares nothing before)."""
    assert sidecar.model.offer(STAND_IN_IDENTITY.to_dict()) == ""
    return sidecar
