"""Reading a running operator's /metrics (the real prometheus-client exposition over HTTP)."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for_async

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    """{(sample name, labels): value} from ``http://127.0.0.1:port/metrics``."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as reply:
            assert reply.status == 200, await reply.text()
            text = await reply.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape_or_none(port: int) -> Samples | None:
    """Like ``scrape``, or None while nothing listens on ``port`` yet."""
    try:
        return await scrape(port)
    except aiohttp.ClientConnectionError:
        return None


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; fails naming the sample when it is not exposed."""
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} is not exposed; exposed: {sorted(n for n, _ in samples)}"
    return samples[key]


async def wait_for_metrics(port: int, probe: Callable[[Samples], bool] = lambda samples: True,
                           timeout: float = 30.0, log: Callable[[], str] = lambda: "") -> Samples:
    """The samples served on ``port`` once ``probe`` accepts them; fails with the last scrape and ``log()``."""
    last: list[Samples | None] = [None]

    async def accepted() -> Samples | None:
        last[0] = await scrape_or_none(port)
        return last[0] if last[0] is not None and probe(last[0]) else None

    try:
        return await wait_for_async(f"the metrics on port {port} to match", accepted, timeout)
    except AssertionError:
        raise AssertionError(f"the metrics on port {port} never matched; last scrape: {last[0]}\n"
                             f"{log()[-3000:]}") from None
