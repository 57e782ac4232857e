"""lifecycle.running: every part up in order, the control ports behind their connection guard, and
one rejection log for both ports of a sidecar."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from kv_offload_sidecar.lifecycle import running
from kv_offload_sidecar.sidecar import Sidecar
from sidecar_support import identified
from waiting import SAFETY_SECONDS, wait_for_async



def unproven(sidecar: Sidecar) -> float:
    value = sidecar.registry.get_sample_value("kv_offload_control_connections", {"state": "unproven"})
    return value or 0.0


async def http(port: int, request: bytes, source: str = "127.0.0.2") -> bytes:
    """Send one request from ``source`` and read until the sidecar closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), SAFETY_SECONDS)
    finally:
        writer.close()


async def test_running_serves_every_control_port_behind_the_connection_guard(make_settings):
    sidecar = Sidecar(make_settings())
    port = sidecar.settings.network.control_port(0)
    async with running(sidecar):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        await wait_for_async("the guard to count the stranger", lambda: unproven(sidecar) == 1)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), SAFETY_SECONDS)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\nServer: kv-offload\r\n" in answer, answer
        await wait_for_async("the guard to forget the stranger", lambda: unproven(sidecar) == 0)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_both_ports_note_their_refusals_in_the_sidecars_one_rejection_log(make_settings, caplog):
    caplog.set_level(logging.WARNING)
    sidecar = identified(Sidecar(make_settings()))  # 503 before: a wait, not a refusal
    async with running(sidecar):
        body = json.dumps({"step": "hello", "wire_version": "1.0", "nonce": "00" * 16,
                           "key_ids": ["00" * 8]}).encode()
        answer = await http(sidecar.settings.network.control_port(0),
                            b"POST /v1/handshake HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n"
                            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert answer.startswith(b"HTTP/1.1 403") and b"other_pool" in answer, answer
        host, port = sidecar.data_address.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
        await reader.read(1)  # the challenge has come: what follows is a frame
        writer.write(b"JUNK" + bytes(12))
        await asyncio.wait_for(reader.read(), SAFETY_SECONDS)
        writer.close()
        await wait_for_async("both refusals noted", lambda: sidecar.rejections.lines == 2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected 127.0.0.2")]
    assert [line.split(":")[1] for line in lines] == [" handshake other_pool", " malformed"], lines
    assert "(data port)" in lines[1]
