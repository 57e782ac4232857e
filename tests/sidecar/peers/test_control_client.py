"""The links' HTTP client: its connections, idle ones included, stay within the bound."""

from __future__ import annotations

import contextlib

from aiohttp import web
from kv_offload_sidecar.peers.control_client import BoundedConnector, control_client


async def _servers(n: int) -> tuple[list[web.AppRunner], list[str]]:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({})

    runners, urls = [], []
    for _ in range(n):
        app = web.Application()
        app.router.add_post("/v1/locate", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}/v1/locate")
    return runners, urls


async def test_messages_to_more_peers_than_the_bound_keep_at_most_the_bound_open_closing_the_oldest_idle():
    runners, urls = await _servers(4)
    http = control_client(5.0, limit=2)
    try:
        connector = http.connector
        assert isinstance(connector, BoundedConnector)
        for url in urls:  # one after the other: each leaves an idle connection behind
            async with http.post(url, json={}) as resp:
                assert resp.status == 200
        assert connector.idle_count() == 2 and connector.trimmed == 2
        # The two kept are the most recent peers': a message to one of them reuses its connection.
        async with http.post(urls[-1], json={}) as resp:
            assert resp.status == 200
        assert connector.idle_count() == 2 and connector.trimmed == 2
    finally:
        await http.close()
        for runner in runners:
            with contextlib.suppress(Exception):
                await runner.cleanup()
