"""A TCP proxy that damages data-plane traffic on purpose (chaos bench and tests).

``FaultProxy(target_host, target_port)`` listens on 127.0.0.1 and forwards
every accepted connection to the target. Bytes going the ``downstream`` way
(target -> client, where chunks travel) pass untouched until
``FaultPlan.after_bytes`` of them went through on that connection; then the
plan's fault applies:

- ``flip``: XOR one byte with ``0xFF`` every ``flip_every`` bytes (headers,
  keys, checksums or chunk bytes, wherever they fall);
- ``truncate``: forward nothing more and close both sides (a peer that dies
  half-way through a chunk);
- ``delay``: hold every later read for ``delay_seconds`` before forwarding
  (a slow link or a peer past the fetch deadline);
- ``pass``: no fault.

``on_fault`` (optional) is called once per connection when its fault starts, so
a bench can act at an exact byte offset (e.g. SIGKILL the serving peer
mid-chunk). ``reset_all()`` drops every open connection at once (a reconnect
storm). The plan can be changed at any time; a connection takes the plan in
force when it was accepted. ``bytes_downstream`` counts what went through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Fault kinds a plan may name.
FAULT_MODES = ("pass", "flip", "truncate", "delay")
# Bytes read from a socket per forwarding step.
READ_BYTES = 64 * 1024


@dataclass(frozen=True)
class FaultPlan:
    """What the proxy does to the downstream bytes of each new connection."""

    # One of FAULT_MODES.
    mode: str = "pass"
    # Downstream bytes forwarded untouched before the fault starts (per connection).
    after_bytes: int = 0
    # flip: distance in bytes between flipped bytes (1 = every byte).
    flip_every: int = 4096
    # delay: seconds each later read is held back.
    delay_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault mode {self.mode!r} is unknown; use one of {list(FAULT_MODES)}")
        for name, low in (("after_bytes", 0), ("flip_every", 1), ("delay_seconds", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {low}")


class FaultProxy:
    """Forwards 127.0.0.1 connections to ``target`` and injects ``plan``'s fault."""

    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1",
                 port: int = 0, plan: FaultPlan | None = None,
                 on_fault: Callable[[FaultPlan], None] | None = None) -> None:
        self.target = (target_host, target_port)
        self._bind = (host, port)
        self.plan = plan or FaultPlan()
        self.on_fault = on_fault
        # Bytes forwarded target -> client, all connections together.
        self.bytes_downstream = 0
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.host = host
        self.port = 0

    @property
    def address(self) -> str:
        """``tcp://host:port`` of the listening side."""
        return f"tcp://{self.host}:{self.port}"

    async def start(self) -> str:
        """Listen; returns ``tcp://host:port``."""
        self._server = await asyncio.start_server(self._accept, *self._bind)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        return self.address

    async def stop(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self.reset_all()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    def reset_all(self) -> None:
        """Abort every open connection (both sides see a reset)."""
        for w in list(self._writers):
            if not w.transport.is_closing():
                w.transport.abort()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        plan = self.plan
        try:
            try:
                t_reader, t_writer = await asyncio.open_connection(*self.target)
            except OSError as exc:
                log.debug("fault proxy: target %s:%d unreachable: %s", *self.target, exc)
                return
            self._writers.update((c_writer, t_writer))
            up = asyncio.create_task(self._pump_up(c_reader, t_writer))
            down = asyncio.create_task(self._pump_down(t_reader, c_writer, plan))
            try:
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (up, down):
                    t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
                self._writers.discard(t_writer)
                _close(t_writer)
        except asyncio.CancelledError:
            pass  # stop(): this connection task ends quietly
        finally:
            self._writers.discard(c_writer)
            _close(c_writer)
            self._conns.discard(task)

    async def _pump_up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(READ_BYTES):
                writer.write(data)
                await writer.drain()

    async def _pump_down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         plan: FaultPlan) -> None:
        passed = 0  # downstream bytes forwarded on this connection
        started = plan.mode == "pass"
        next_flip = plan.after_bytes
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(READ_BYTES):
                if not started and passed + len(data) > plan.after_bytes:
                    started = True
                    keep = plan.after_bytes - passed
                    if keep:
                        writer.write(data[:keep])
                        await writer.drain()
                        passed += keep
                        self.bytes_downstream += keep
                        data = data[keep:]
                    self._fault_started(plan)
                    if plan.mode == "truncate":
                        return
                if started and plan.mode == "flip":
                    buf = bytearray(data)
                    while next_flip < passed + len(buf):
                        buf[next_flip - passed] ^= 0xFF
                        next_flip += plan.flip_every
                    data = bytes(buf)
                elif started and plan.mode == "delay" and plan.delay_seconds:
                    await asyncio.sleep(plan.delay_seconds)
                writer.write(data)
                await writer.drain()
                passed += len(data)
                self.bytes_downstream += len(data)

    def _fault_started(self, plan: FaultPlan) -> None:
        if self.on_fault is not None:
            try:
                self.on_fault(plan)
            except Exception:  # a bench hook must not break forwarding
                log.exception("fault proxy: on_fault hook failed")


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
