"""``data.planes``: what tells a UCX open that it reached the holder's host. A UCX endpoint makes
no TCP connection of its own, so the open dials the holder's control port beside it
(``dial_to_reach``); the cut that keeps it from ever getting there is in
``tests/tools/netns/test_netns_liveness.py``."""

from __future__ import annotations

import asyncio
import socket

from kv_offload_sidecar.data.planes import dial_to_reach


async def test_a_port_that_accepts_is_reached_and_hears_nothing_but_the_close() -> None:
    heard: list[bytes] = []
    accepted = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read())
        accepted.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    reached: list[str] = []
    async with server:
        port = server.sockets[0].getsockname()[1]
        await dial_to_reach(f"127.0.0.1:{port}", lambda: reached.append("reached"), 5.0)
        await asyncio.wait_for(accepted.wait(), 5.0)
    assert reached == ["reached"]
    assert heard == [b""]


async def test_a_port_that_refuses_is_reached_too_the_host_answered() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    reached: list[str] = []
    await dial_to_reach(f"127.0.0.1:{port}", lambda: reached.append("reached"), 5.0)
    assert reached == ["reached"]


async def test_an_address_that_is_not_host_and_port_is_never_reached_and_raises_nothing() -> None:
    reached: list[str] = []
    await dial_to_reach("no-port-here", lambda: reached.append("reached"), 5.0)
    assert reached == []
