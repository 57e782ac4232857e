"""Chunks fetched from peers and not loaded yet, remembered by the asker so that it can drop
or demote its copies once a load took them (the sidecar's ``--peer-copies`` policy), or let
them go when no load came (a request preempted or aborted). A key is remembered when its
exchange asks for it, before it lands (a load may pin it before the exchange returns), and
forgotten when its holder's count or the exchange's end says it is not coming. At most
``MAX_FETCHED`` are remembered, the oldest forgotten first. Used on one event loop only."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Fetched chunks remembered until their load drops or demotes them (oldest forgotten first).
MAX_FETCHED = 65536


class FetchedCopies:
    """Fetched chunk keys, oldest first, with when they were asked."""

    def __init__(self) -> None:
        # Key -> monotonic time its exchange asked for it (oldest first).
        self._asked: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._asked)

    def remember(self, keys: Iterable[bytes]) -> None:
        now = time.monotonic()
        for k in keys:
            self._asked[k] = now
            self._asked.move_to_end(k)
        while len(self._asked) > MAX_FETCHED:
            self._asked.popitem(last=False)

    def forget(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._asked.pop(k, None)

    def take(self, keys: Sequence[bytes]) -> list[bytes]:
        """Which of ``keys`` came from peers, forgotten here (the caller drops or demotes them)."""
        out = [k for k in keys if k in self._asked]
        self.forget(out)
        return out

    def take_older_than(self, seconds: float) -> list[bytes]:
        """The keys asked more than ``seconds`` ago, forgotten here."""
        limit = time.monotonic() - seconds
        out = []
        while self._asked:
            key, asked = next(iter(self._asked.items()))
            if asked > limit:
                break
            del self._asked[key]
            out.append(key)
        return out
