"""The sidecar's one lifecycle owner: start every part in order, serve, stop in reverse order.

``running(sidecar)`` starts the store, data plane, discovery and peer links
(``Sidecar.start``), then one local-channel server per DP index this pod serves and
``control.app.ControlPorts``: every control port behind one connection guard, so every
way of running a sidecar (``kv-offload sidecar``, a local pool, an in-process test) gets
the limits on strangers of ``control/limits.py``. Leaving it stops accepting on the
control ports, gives in-flight engine work ``shutdown_grace_seconds`` on the local
channels, and stops the sidecar (which unlinks its shared-memory store). ``serve`` runs
that until ``stop`` is set, keeping the pod's last good config meanwhile
(``last_good_config``). Nothing else starts or stops these parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kv_offload_sidecar.control.app import ControlPorts
from kv_offload_sidecar.control.local_channel import LocalChannelServer
from kv_offload_sidecar.last_good_config import forget, keep, last_good_path
from kv_offload_sidecar.sidecar import Sidecar

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(sidecar: Sidecar, *, control_ports: bool = True) -> AsyncIterator[Sidecar]:
    """The sidecar with all its parts up; ``control_ports=False`` leaves the control apps to
    the caller (tests serve them in process, or start their own ``ControlPorts``)."""
    s = sidecar.settings
    channels: list[LocalChannelServer] = []
    ports: ControlPorts | None = None
    await sidecar.start()
    try:
        for idx in s.network.dp_indices:
            channel = LocalChannelServer(sidecar, idx)
            await channel.start()
            channels.append(channel)
        if control_ports:
            ports = ControlPorts(sidecar)
            await ports.start()  # stopped below even when one port is taken (OSError)
        yield sidecar
    finally:
        if sidecar.ready:
            log.info("sidecar %s shutting down", s.network.identity)
        sidecar.ready = False
        if ports is not None:
            await ports.stop()
        for channel in reversed(channels):
            await channel.stop(s.process.shutdown_grace_seconds)
        await sidecar.stop()


async def serve(sidecar: Sidecar, stop: asyncio.Event) -> None:
    """Run the sidecar until ``stop`` is set, then shut it down. While it serves, the config it
    runs is its pod's last good one (``last_good_config.keep``: a killed sidecar's restart
    falls back on it), forgotten at a clean stop; ``kv_offload_config_rejected`` says whether
    it runs the file or, the file refused, the saved one."""
    s = sidecar.settings
    sidecar.metrics.config_rejected.set(1 if s.pool.config_rejected else 0)
    saved = last_good_path(s.store.shm_dir, s.network.identity)
    async with running(sidecar):
        keep(saved, s.pool.config, s.pool.declared_identity)
        await stop.wait()
    forget(saved)
