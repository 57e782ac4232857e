"""Waiting for a state the code exposes: the one poll loop of the test tree.

A test waits for what it means (a counter, a status field, a listening port, an
exit) by polling a probe until the probe returns something truthy, which it
then gets back. The deadline only keeps a broken build from hanging the suite:
it is generous and never the judge of a behaviour. On expiry the failure names
what never came and the probe's last answer.

Importable from every test folder: pytest puts ``tests/`` (the folder of the
suite's conftest.py) on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Seconds before a wait gives up: a safety net against a hang, far above what any wait needs
# (a real vLLM engine on two busy cores included).
SAFETY_SECONDS = 120.0
# Seconds between two probes.
POLL_SECONDS = 0.05


def _gave_up(what: str, timeout: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last probe: {last!r})")


def wait_for(what: str, probe: Callable[[], T], timeout: float = SAFETY_SECONDS,
             interval: float = POLL_SECONDS) -> T:
    """``probe()``'s first truthy answer; fails naming ``what`` after ``timeout`` seconds."""
    return wait_until(what, probe, bool, timeout, interval)


def wait_until(what: str, read: Callable[[], T], accept: Callable[[T], object],
               timeout: float = SAFETY_SECONDS, interval: float = POLL_SECONDS) -> T:
    """The first value ``read()`` returns that ``accept`` accepts (a snapshot of counters, say):
    on expiry the failure shows the last snapshot, not merely that a check was false."""
    deadline = time.monotonic() + timeout
    while not accept(value := read()):
        if time.monotonic() > deadline:
            raise _gave_up(what, timeout, value)
        time.sleep(interval)
    return value


async def wait_for_async(what: str, probe: Callable[[], T | Awaitable[T]], timeout: float = SAFETY_SECONDS,
                         interval: float = POLL_SECONDS) -> T:
    """``wait_for`` inside an event loop: the loop keeps running between probes, and a probe
    may be a coroutine function (a scrape, a request)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise _gave_up(what, timeout, value)
        await asyncio.sleep(interval)


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port`` (a probe for ``wait_for``)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True
