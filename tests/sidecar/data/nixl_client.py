"""NIXL client scenarios, each in its own process (the NIXL agents live per process).

``python nixl_client.py SCENARIO --address nixl://... --server-pid P --chunks N --chunk-bytes B
--shm-dir D [--corrupt i,j]`` prints the outcome as one JSON line. The revoke scenario
prints ``{"ready": ...}`` first and waits for a line on stdin (the test ends the server's
sessions meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from transport_peers import SESSION_ID, SESSION_KEY, client_scenario, key_of


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async def released(client: Any, keys: list[bytes]) -> dict[str, Any]:
        await client.lookup(keys[:1], timeout=5)  # the RELEASEs went out before this reply
        return {}

    return await client_scenario(args, "nixl-cli", 20, released, {"revoke": _revoke})


async def _revoke(args: argparse.Namespace, keys: list[bytes], store: Any) -> dict[str, Any]:
    """Fetch, keep the holder's metadata, let the test end the session; then READ through
    that metadata (re-loaded as a fetcher that kept it would): the holder must have revoked it."""
    from kv_offload_sidecar.data import TransportError, connect
    from kv_offload_sidecar.data.nixl.runtime import LaneError, NixlRuntime

    out: dict[str, Any] = {}
    client = await connect(args.address, SESSION_ID, SESSION_KEY, timeout=20)
    out["fetched"] = await client.fetch(keys[:2], store, timeout=20)
    view = client._remote.view  # what the holder told this connection
    runtime = await NixlRuntime.get()
    lane = runtime.lanes[0]
    local = (await runtime.register_local(store))[0]

    async def raw_read() -> str:
        res = store.begin_write(key_of(99_999))
        try:
            def read(lane: Any) -> int | None:
                name = lane.load_remote(view.metadata)
                far = lane.prep_table(name, view.base, view.slot_stride, view.slot_bytes, view.num_slots)
                try:
                    return lane.read(name, local, res.slot, far, 0, res.view, True)
                finally:
                    lane.unload_remote(name, now=True, table=far)
            digest = await lane.call(read)
            if digest is None:
                return "none"
            return "read" if any(res.view) else "zeros"  # a dark range reads zeros
        except LaneError as exc:
            return f"failed: {exc}"
        finally:
            res.abort()

    out["raw_read_before"] = await raw_read()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # the test ends every session on the server now
    out["raw_read_after"] = await raw_read()
    try:
        out["fetch_after"] = await client.fetch(keys[2:4], store, timeout=5)
    except TransportError as exc:
        out["fetch_after"] = f"error: {exc}"
    await client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--address", required=True)
    parser.add_argument("--server-pid", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--corrupt", default="")
    args = parser.parse_args()
    from kv_offload_sidecar.data.nixl.runtime import configure_nixl_env

    configure_nixl_env()
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
