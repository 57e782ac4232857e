"""An unexpected error while handling one local-channel request (control/local_channel.py):
the engine gets an error answer and the connection serves its next request."""

from __future__ import annotations

import asyncio
import logging

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.sidecar import Sidecar

# Bound on any one wait of a test.
PATIENCE = 10.0


class TrippingSidecar(Sidecar):
    """A sidecar whose lookup fails as aiohttp's client once did inside a peer's lookup."""

    async def lookup(self, keys, timeout, *, fetch=True):
        raise AttributeError("'NoneType' object has no attribute 'getall'")


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: dict) -> dict:
    writer.write(cp.encode_frame(req))
    await writer.drain()
    head = await asyncio.wait_for(reader.readexactly(cp.LENGTH.size), PATIENCE)
    return cp.decode_body(await asyncio.wait_for(reader.readexactly(cp.frame_length(head)), PATIENCE))


async def test_a_request_failing_unexpectedly_is_answered_and_the_channel_keeps_serving(make_settings, caplog):
    sidecar = TrippingSidecar(make_settings())
    async with running(sidecar, control_ports=False):
        reader, writer = await asyncio.open_unix_connection(sidecar.local_socket_path(0))
        try:
            with caplog.at_level(logging.WARNING, logger="kv_offload_sidecar.control.local_channel"):
                for _ in range(2):  # the first frame of a connection and a later one
                    reply = await ask(reader, writer, {"op": "lookup", "keys": cp.encode_keys([b"\x01" * 16]),
                                                       "timeout": 1.0})
                    assert reply["ok"] is False and "AttributeError" in reply["error"]
            info = await ask(reader, writer, {"op": "info"})
            assert info["ok"] is True and info["instance"] == sidecar.instance
        finally:
            writer.close()
    lines = [r for r in caplog.records if "AttributeError" in r.getMessage()]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)
