"""The sidecar's watch on its own event loop: a loop held past the threshold is a stall that
excuses exchanges it overlapped, and only those."""

from __future__ import annotations

import asyncio
import contextlib
import time

from kv_offload_sidecar.loop_stalls import STALL_SECONDS, TICK_SECONDS, LoopStalls
from waiting import wait_for_async

# Seconds the tests hold the loop: a tick due within it comes a stall late.
HELD_SECONDS = TICK_SECONDS + 2 * STALL_SECONDS


async def _watching() -> tuple[LoopStalls, asyncio.Task[None]]:
    stalls = LoopStalls()
    task = asyncio.create_task(stalls.run())
    await asyncio.sleep(0)  # run() started its ticks
    return stalls, task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_loop_held_past_the_threshold_excuses_an_exchange_begun_before_even_before_its_tick():
    stalls, task = await _watching()
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        time.sleep(HELD_SECONDS)  # this process's loop cannot run: what a SIGSTOP or a CPU quota does
        assert stalls.count == 0  # the tick that would record it has not run yet...
        assert stalls.excuse(began)  # ...and the stall is seen all the same
        await wait_for_async("the tick to record the stall", lambda: stalls.count)
        assert stalls.spanned(began)
        view = stalls.view()
        assert view["count"] == 1 and view["peer_failures_excused"] == 1
        assert view["longest_seconds"] >= HELD_SECONDS - TICK_SECONDS - 0.01  # the tick's lateness
    finally:
        await _stop(task)


async def test_an_exchange_begun_after_the_stall_ended_is_not_excused():
    stalls, task = await _watching()
    try:
        time.sleep(HELD_SECONDS)
        await wait_for_async("the tick to record the stall", lambda: stalls.count)
        began = asyncio.get_running_loop().time()
        assert not stalls.excuse(began)
        assert stalls.excused == 0
    finally:
        await _stop(task)


async def test_a_watch_not_running_excuses_nothing():
    stalls = LoopStalls()
    time.sleep(HELD_SECONDS)
    assert not stalls.spanned(float("-inf"))
