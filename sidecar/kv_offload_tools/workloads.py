"""Generated request streams for the replay bench (``--generate``): chat conversations.

``conversation(spec)`` builds the workload a chat service sees: sessions
arrive over time; each opens with one of a few shared system prompts (some
short, some long, the popular ones more often); every turn's prompt is the
previous turn's prompt plus the previous answer plus a new user message, so a
session's prompts are growing prefixes of each other; the user thinks between
turns, so other sessions' requests come in between. Deterministic per seed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kv_offload_tools.mooncake_trace import TraceRequest

WORKLOADS = ("conversation",)


@dataclass(frozen=True)
class ConversationSpec:
    """What ``conversation`` generates."""

    # Chat sessions in the stream.
    sessions: int
    # Requests (turns) per session.
    turns: int
    # Distinct system prompts shared between sessions (popularity ~ 1 / rank).
    system_prompts: int = 6
    # Blocks of a short system prompt (even ranks) and of a long one (odd ranks).
    short_system_blocks: int = 2
    long_system_blocks: int = 16
    # Blocks of one user message: uniform in [min, max].
    user_blocks: tuple[int, int] = (1, 3)
    # Blocks of one answer: uniform in [min, max].
    answer_blocks: tuple[int, int] = (1, 2)
    # Mean seconds between two sessions' first requests (exponential).
    arrival_seconds: float = 1.0
    # Mean seconds a user thinks between an answer and the next turn (exponential).
    think_seconds: float = 20.0
    # Seed of every random choice.
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_prompts", "short_system_blocks", "long_system_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        for name in ("user_blocks", "answer_blocks"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} {getattr(self, name)} must be 1 <= min <= max")
        if self.arrival_seconds <= 0 or self.think_seconds < 0:
            raise ValueError("arrival_seconds must be positive and think_seconds not negative")


def conversation(spec: ConversationSpec) -> list[TraceRequest]:
    """The requests of ``spec.sessions`` conversations, interleaved in arrival order."""
    rng = random.Random(spec.seed)
    ids = _ids()
    systems = [tuple(next(ids) for _ in range(spec.long_system_blocks if rank % 2 else
                                              spec.short_system_blocks))
               for rank in range(spec.system_prompts)]
    weights = [1.0 / (rank + 1) for rank in range(spec.system_prompts)]
    # (time of the session's next turn, session, turn, prompt so far, last answer)
    pending: list[tuple[float, int, int, tuple[int, ...], tuple[int, ...]]] = []
    start = 0.0
    for session in range(spec.sessions):
        start += rng.expovariate(1.0 / spec.arrival_seconds)
        system = rng.choices(systems, weights)[0]
        heapq.heappush(pending, (start, session, 0, system, ()))
    out: list[TraceRequest] = []
    while pending:
        at, session, turn, prompt, answer = heapq.heappop(pending)
        user = tuple(next(ids) for _ in range(rng.randint(*spec.user_blocks)))
        prompt = prompt + answer + user
        reply = tuple(next(ids) for _ in range(rng.randint(*spec.answer_blocks)))
        out.append(TraceRequest(int(at * 1000), prompt, len(reply), session))
        if turn + 1 < spec.turns:
            think = rng.expovariate(1.0 / spec.think_seconds) if spec.think_seconds else 0.0
            heapq.heappush(pending, (at + think, session, turn + 1, prompt, reply))
    return out


def _ids() -> Iterator[int]:
    n = 0
    while True:
        n += 1
        yield n
