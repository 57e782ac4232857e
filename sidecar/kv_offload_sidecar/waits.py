"""Bounded waits of the sidecar's event loop.

Python 3.11's ``asyncio.wait_for`` loses a cancellation that arrives as the wait it
guards completes: a task cancelled then keeps running (a peer link's loop outlived the
sidecar's stop that way). Waits here are ``asyncio.timeout`` scopes, which do not.
"""

from __future__ import annotations

import asyncio


async def set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds`` (waiting no longer)."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
