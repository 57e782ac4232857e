"""The engine's prefill rate, learnt from vLLM's own metrics.

vLLM exports, per request, the KV tokens it computed in prefill (cached ones
excluded: ``vllm:request_prefill_kv_computed_tokens``) and the time the request
spent in prefill (``vllm:request_prefill_time_seconds``). Between two scrapes of
the engine's ``/metrics`` the growth of the first sum over the growth of the
second is the tokens a request's prefill computed per second: how long vLLM
takes to recompute a prefix, the quantity fetch-or-recompute weighs a fetch
against. ``PrefillRateLearner`` scrapes every interval and feeds the moving
average to ``FetchOrRecompute.learn_rate``; until it has a sample (or when the
engine cannot be reached) the configured rate stands.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# The sums of vLLM's histograms the rate is the ratio of (all engines and label sets added).
TOKENS_SUM = "vllm:request_prefill_kv_computed_tokens_sum"
SECONDS_SUM = "vllm:request_prefill_time_seconds_sum"
# Prefill seconds two scrapes must be apart (summed over requests) to give a sample.
MIN_SECONDS = 0.05
# Weight of the newest sample in the moving average.
WEIGHT = 0.3


def prefill_totals(text: str) -> tuple[float, float] | None:
    """(prefill tokens computed, prefill seconds) summed over a Prometheus text page;
    None when the page has neither. Each line naming one of the two sums is read by
    prometheus_client's parser (the value, not a trailing timestamp; label values with
    spaces or braces); a line it refuses is skipped."""
    sums = {TOKENS_SUM: 0.0, SECONDS_SUM: 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith((TOKENS_SUM, SECONDS_SUM)):
            continue
        try:
            samples = [s for family in text_string_to_metric_families(line + "\n")
                       for s in family.samples]
        except ValueError:
            continue
        for sample in samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
                seen = True
    return (sums[TOKENS_SUM], sums[SECONDS_SUM]) if seen else None


class PrefillRateLearner:
    """Scrapes ``url`` every ``interval`` seconds; ``learn(rate)`` gets the moving average."""

    def __init__(self, url: str, interval: float, learn: Callable[[float], None]) -> None:
        self.url = url
        self._interval = interval
        self._learn = learn
        self._last: tuple[float, float] | None = None
        # The current moving average (None before the first sample).
        self.rate: float | None = None
        self._warned = False

    def observe(self, totals: tuple[float, float]) -> float | None:
        """One scrape's totals; returns the rate learnt from it, if any."""
        last, self._last = self._last, totals
        if last is None:
            return None
        tokens, seconds = totals[0] - last[0], totals[1] - last[1]
        if seconds < MIN_SECONDS or tokens <= 0:
            return None  # idle, or an engine restart (the counters went back)
        sample = tokens / seconds
        self.rate = sample if self.rate is None else self.rate + WEIGHT * (sample - self.rate)
        self._learn(self.rate)
        return sample

    async def run(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=max(1.0, self._interval))
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
            while True:
                try:
                    async with http.get(self.url) as resp:
                        text = await resp.text() if resp.status == 200 else ""
                    totals = prefill_totals(text)
                    if totals is None:
                        self._warn(f"its answer has no {TOKENS_SUM} or {SECONDS_SUM}")
                    else:
                        self.observe(totals)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    self._warn(str(exc) or type(exc).__name__)
                await asyncio.sleep(self._interval)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("cannot learn the engine's prefill rate from %s (%s); the configured "
                        "--prefill-tokens-per-second stands", self.url, why)
