"""One asyncio loop per process for the chaos runs' hand-driven peers.

The nixl transport's runtime (this process's NIXL agents) binds to the first event loop
that uses it, so the wire scenarios run every coroutine on this one loop (a daemon thread)
instead of an ``asyncio.run`` each, whatever the transport.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_state: dict[str, Any] = {"loop": None}
_lock = threading.Lock()


def chaos_loop() -> asyncio.AbstractEventLoop:
    """The process's chaos loop, started at first use."""
    with _lock:
        loop = _state["loop"]
        if loop is None:
            loop = _state["loop"] = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="kvo-chaos-loop", daemon=True).start()
        return loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the chaos loop and return its result (or raise its error)."""
    return asyncio.run_coroutine_threadsafe(coro, chaos_loop()).result()
