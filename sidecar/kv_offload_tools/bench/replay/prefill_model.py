"""Prefill time a replay saves, under a stated model of the engine and the links between pods.

The replay measures, per request, how many chunks came from the replica's own
store, how many from peers, and how many were asked. This module prices them:
the engine prefills ``tokens_per_second`` prompt tokens per second (linear: no
attention term, so long prefixes are undervalued), a chunk is
``tokens_per_chunk`` tokens of ``kv_bytes_per_token`` bytes each, a local
chunk loads for free, and a peer run costs one round trip plus its bytes over
the link. For each modelled link it reports the prefill seconds without
offloading, with every peer run fetched, and with the sidecar's own
fetch-or-recompute decision (``peers.fetch_cost.FetchOrRecompute``, fed the
link's latency and bandwidth as its moving averages would settle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_offload_sidecar.peers.fetch_cost import FetchOrRecompute, PrefillModel

LINK = "modelled-link"


@dataclass(frozen=True)
class PrefillSettings:
    # The engine's prefill rate in prompt tokens per second, e.g. 10000.
    tokens_per_second: float = 10_000.0
    # Tokens of one replayed chunk (a Mooncake block: 512).
    tokens_per_chunk: int = 512
    # KV bytes per token of the modelled model (Llama-3-8B, bf16, 8 KV heads: 131072).
    kv_bytes_per_token: int = 131_072
    # Link bandwidths modelled, bytes per second (10 GbE: 1.25e9; 200 Gb/s RDMA: 25e9).
    links: tuple[float, ...] = (1.25e9, 25e9)
    # Round trip of one exchange with a holder, seconds.
    latency_seconds: float = 0.0005

    def __post_init__(self) -> None:
        if not self.tokens_per_second > 0:
            raise ValueError(f"--prefill-tokens-per-second {self.tokens_per_second} must be positive")
        if self.tokens_per_chunk < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("--tokens-per-chunk and --kv-bytes-per-token must be at least 1")
        if not self.links or any(not b > 0 for b in self.links):
            raise ValueError(f"--links {self.links} must be positive GB/s values, e.g. 1.25,25")
        if self.latency_seconds < 0:
            raise ValueError(f"--link-latency-ms must be >= 0, got {self.latency_seconds * 1000}")

    @property
    def chunk_bytes(self) -> int:
        return self.tokens_per_chunk * self.kv_bytes_per_token


def prefill_savings(model: PrefillSettings, outcomes: Sequence[tuple[int, int, int]]) -> list[dict]:
    """One row per link from per-request ``(local chunks, peer chunks, chunks asked)``."""
    per_chunk = model.tokens_per_chunk / model.tokens_per_second
    rows = []
    for link in model.links:
        decide = FetchOrRecompute(PrefillModel(model.tokens_per_second, model.tokens_per_chunk,
                                               model.chunk_bytes))
        decide.speeds.observe_latency(LINK, model.latency_seconds)
        decide.speeds.observe_transfer(LINK, model.chunk_bytes, model.chunk_bytes / link)
        without = always = chosen = 0.0
        fetched = recomputed = 0
        for local, peer, asked in outcomes:
            rest = (asked - local - peer) * per_chunk
            without += asked * per_chunk
            if not peer:
                always += rest
                chosen += rest
                continue
            fetch = model.latency_seconds + peer * model.chunk_bytes / link
            always += rest + fetch
            if decide.worth(LINK, peer):
                chosen += rest + fetch
                fetched += 1
            else:
                chosen += rest + peer * per_chunk
                recomputed += 1
        rows.append({
            "link_gb_per_second": link / 1e9,
            "prefill_seconds_without_offload": without,
            "prefill_seconds_always_fetch": always,
            "prefill_seconds_fetch_or_recompute": chosen,
            "saved_always_fetch": _share(without - always, without),
            "saved_fetch_or_recompute": _share(without - chosen, without),
            "peer_runs_fetched": fetched,
            "peer_runs_recomputed": recomputed,
        })
    return rows


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def format_rows(model: PrefillSettings, rows: Sequence[dict]) -> list[str]:
    head = (f"  prefill model: {model.tokens_per_second:g} tokens/s, {model.tokens_per_chunk} tokens x "
            f"{model.kv_bytes_per_token} B per chunk ({model.chunk_bytes / 2**20:.0f} MiB), "
            f"{model.latency_seconds * 1000:g} ms per holder exchange")
    lines = [head, "  link GB/s  prefill s (none)  always fetch  fetch-or-recompute  saved (always)  "
             "saved (decided)  runs fetched/recomputed"]
    for r in rows:
        lines.append(f"  {r['link_gb_per_second']:<9g}  {r['prefill_seconds_without_offload']:<15.1f}  "
                     f"{r['prefill_seconds_always_fetch']:<12.1f}  {r['prefill_seconds_fetch_or_recompute']:<18.1f}  "
                     f"{r['saved_always_fetch']:<14.1%}  {r['saved_fetch_or_recompute']:<15.1%}  "
                     f"{r['peer_runs_fetched']}/{r['peer_runs_recomputed']}")
    return lines
