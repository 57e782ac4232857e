"""Stalls of the sidecar's own event loop, so a peer is not blamed for them.

A peer exchange that misses its deadline backs the peer off (``links``). When the
deadline passed while this process could not run (stopped, throttled by its CPU quota,
swapped out, starved by a noisy neighbour), the peer did nothing wrong: backing it off
turns the next lookups into misses for no reason. ``LoopStalls`` ticks every
``TICK_SECONDS`` and records a stall when a tick comes ``STALL_SECONDS`` or more late;
``spanned(since)`` says whether a stall overlapped an exchange that started at
``since``, counting a stall the loop is only now coming out of (a tick overdue by that
much). The peer path then counts such a failure as a miss and leaves the link alone; a
connection that really broke is still caught by the link's own watch (``links``).

Times are the event loop's clock (``loop.time()``, monotonic: it runs on while the
process is stopped).
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# Seconds between ticks: how soon a stall is seen once the loop runs again (a stall still
# being caught up is seen at once, ``spanned``).
TICK_SECONDS = 0.5
# A tick this many seconds late is a stall (the loop's ordinary lag under load is tens of ms).
STALL_SECONDS = 0.25
# Seconds between two stall log lines; the stalls between are counted, not logged.
LOG_INTERVAL_SECONDS = 10.0


class LoopStalls:
    """Watches the running event loop for stalls (``run`` is its task)."""

    def __init__(self) -> None:
        # Stalls seen since start.
        self.count = 0
        # The longest stall seen, in seconds (how late its tick came: the stall less up to one tick).
        self.longest_seconds = 0.0
        # Peer failures not blamed on the peer because their exchange spanned a stall.
        self.excused = 0
        self._running = False
        self._last_tick = 0.0
        self._last_stall_end = float("-inf")
        self._logged_at = float("-inf")
        self._unlogged = 0
        self._timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        """Tick until cancelled (the sidecar's task). A tick is a bare timer callback, not a
        task step: an idle sidecar pays next to nothing for it."""
        loop = asyncio.get_running_loop()
        self._last_tick, self._running = loop.time(), True
        self._timer = loop.call_later(TICK_SECONDS, self._tick, loop)
        try:
            await loop.create_future()  # never set
        finally:
            self._running = False
            self._timer.cancel()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        late = now - self._last_tick - TICK_SECONDS
        self._last_tick = now
        if late >= STALL_SECONDS:
            self._record(late, now)
        self._timer = loop.call_later(TICK_SECONDS, self._tick, loop)

    def spanned(self, since: float) -> bool:
        """Whether this loop stalled after ``since`` (loop time), or is coming out of a stall
        now."""
        now = asyncio.get_running_loop().time()
        overdue = self._running and now - self._last_tick - TICK_SECONDS >= STALL_SECONDS
        return overdue or self._last_stall_end > since

    def excuse(self, since: float) -> bool:
        """``spanned``, counting the failure it excuses."""
        if not self.spanned(since):
            return False
        self.excused += 1
        return True

    def view(self) -> dict[str, float | int]:
        return {"count": self.count, "longest_seconds": round(self.longest_seconds, 3),
                "peer_failures_excused": self.excused}

    def _record(self, late: float, now: float) -> None:
        self.count += 1
        self.longest_seconds = max(self.longest_seconds, late)
        self._last_stall_end = now
        if now - self._logged_at < LOG_INTERVAL_SECONDS:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} shorter or earlier ones since the last line)" if self._unlogged else ""
        log.warning("this sidecar's event loop stalled for %.2f s%s: the process was paused or starved "
                    "of CPU; peer exchanges that missed their deadline across it are misses that do not "
                    "back the peer off", late, more)
        self._logged_at, self._unlogged = now, 0
