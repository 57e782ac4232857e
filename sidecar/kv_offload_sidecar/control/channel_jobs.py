"""A local channel's jobs: the loads and stores an engine names with a job id, so that
``cancel {jobs}`` (what the tier's ``drain_jobs`` sends) stops them at the next piece.

A cancel may come before its job (the engine gives up on a request whose load frame is
still on the way): the id is remembered, at most ``MAX_EARLY_CANCELS`` of them (the oldest
forgotten first), and the job is cancelled the moment it registers. An id in use twice:
the first job keeps it, the second cannot be cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Iterator
from typing import Any

from kv_offload_sidecar.store.engine_region import JobDeadline

# Cancels of jobs not (yet) running that a channel remembers (the oldest forgotten first).
MAX_EARLY_CANCELS = 1024


async def unless_cancelled(work: Awaitable[Any], stop: asyncio.Event) -> None:
    """Await ``work`` until it ends or ``stop`` is set (then it is cancelled and awaited)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not task.cancelled():
        task.result()


class ChannelJobs:
    """The running jobs of one local channel and the cancels that came early."""

    def __init__(self) -> None:
        # Jobs running with an id: how to stop each (its deadline, the event its fetch awaits).
        self._running: dict[str, tuple[JobDeadline, asyncio.Event]] = {}
        # Ids cancelled before their job came (oldest first).
        self._early: OrderedDict[str, None] = OrderedDict()

    @contextlib.contextmanager
    def running(self, job: str | None, deadline: JobDeadline) -> Iterator[asyncio.Event]:
        """Register job ``job`` (None: no id, not cancellable) while it runs; the event is set
        when it is cancelled (at once when its cancel came first)."""
        stop = asyncio.Event()
        if job is None or job in self._running:  # an id in use twice: the first one keeps it
            yield stop
            return
        self._running[job] = (deadline, stop)
        if job in self._early:
            del self._early[job]
            deadline.cancel()
            stop.set()
        try:
            yield stop
        finally:
            del self._running[job]

    def cancel(self, jobs: list[str]) -> int:
        """Stop the running jobs named; remember the others (their request may come later).
        Returns how many were running."""
        n = 0
        for job in jobs:
            found = self._running.get(job)
            if found is None:
                self._early[job] = None
                self._early.move_to_end(job)
                while len(self._early) > MAX_EARLY_CANCELS:
                    self._early.popitem(last=False)
                continue
            deadline, stop = found
            deadline.cancel()
            stop.set()
            n += 1
        return n
