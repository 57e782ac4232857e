"""The sidecar's one lifecycle owner: start every part in order, serve, stop in reverse order.

``running(sidecar)`` starts the store, data plane, discovery and peer links
(``Sidecar.start``), then one local-channel server and one control port per
DP index this pod serves; leaving it stops accepting on the control ports,
gives in-flight engine work ``shutdown_grace_seconds`` on the local channels,
and stops the sidecar (which unlinks its shared-memory store). ``serve`` runs
that until ``stop`` is set. Nothing else starts or stops these parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from kv_offload_sidecar.control.app import create_app
from kv_offload_sidecar.control.local_channel import LocalChannelServer
from kv_offload_sidecar.sidecar import Sidecar

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(sidecar: Sidecar, *, control_ports: bool = True) -> AsyncIterator[Sidecar]:
    """The sidecar with all its parts up; ``control_ports=False`` leaves the aiohttp apps to
    the caller (tests serve them in process)."""
    s = sidecar.settings
    grace = s.shutdown_grace_seconds
    channels: list[LocalChannelServer] = []
    runners: list[web.AppRunner] = []
    await sidecar.start()
    try:
        for idx in s.dp_indices:
            channel = LocalChannelServer(sidecar, idx)
            await channel.start()
            channels.append(channel)
        if control_ports:
            for idx in s.dp_indices:
                runner = web.AppRunner(create_app(sidecar, idx), handle_signals=False,
                                       access_log=None, shutdown_timeout=grace)
                await runner.setup()
                runners.append(runner)
                await web.TCPSite(runner, s.host, s.control_port(idx), reuse_address=True).start()
        yield sidecar
    finally:
        if sidecar.ready:
            log.info("sidecar %s shutting down", s.identity)
        sidecar.ready = False
        for runner in reversed(runners):
            await runner.cleanup()
        for channel in reversed(channels):
            await channel.stop(grace)
        await sidecar.stop()


async def serve(sidecar: Sidecar, stop: asyncio.Event) -> None:
    """Run the sidecar until ``stop`` is set, then shut it down."""
    async with running(sidecar):
        await stop.wait()
