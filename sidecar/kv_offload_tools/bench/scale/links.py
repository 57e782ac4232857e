"""Links per sidecar in ``bench scale``: the peers a member talks to within an idle window.

A sidecar keeps a data link only to the peers it exchanges chunks with (holders it reads
from, askers reading from it), each closed ``DATA_IDLE_SECONDS`` after its last exchange,
at most ``MAX_DATA_LINKS`` open (``peers.data_links``); and control connections to the peers
it sends location messages to (owners it publishes to or asks, those publishing to or
asking it), each closed ``CONTROL_KEEPALIVE_SECONDS`` after its last message, at most
``CONTROL_CONNECTIONS`` of its own open (``peers.control_client``).

From the contacts a run recorded (``(seconds, member, peer)``, both ways), ``peers_in_window``
gives each member's distinct peers within a sliding window of that length: the links it
would hold open without a bound (peak over time, the worst member; and the mean over
members of their peaks). ``connection_opens`` replays one member's sends through a bounded
pool kept like the control client's (idle past the keep-alive closed; past the bound the
least recently used closed): how many connections it opens.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Collection, Iterable, Sequence

# One contact: (seconds, member, peer).
Contact = tuple[float, str, str]
# Which end of a contact counts it.
ENDS = ("both", "from", "to")


def peers_in_window(contacts: Iterable[Contact], window: float,
                    only: Collection[str] | None = None, ends: str = "both") -> dict[str, float]:
    """Distinct peers per member within ``window`` seconds: ``max`` (the worst member's peak),
    ``mean`` (the members' peaks averaged) and ``members`` (members with any contact); of the
    members in ``only`` when given. A contact counts for both ends (``ends="both"``), or only
    for the member that made it (``"from"``: the peers it dialled) or that took it (``"to"``)."""
    if ends not in ENDS:
        raise ValueError(f"ends={ends!r}; use one of {ENDS}")
    by_member: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for t, a, b in contacts:
        if a != b:
            if ends != "to":
                by_member[a].append((t, b))
            if ends != "from":
                by_member[b].append((t, a))
    peaks = []
    for member, events in by_member.items():
        if only is not None and member not in only:
            continue
        events.sort()
        last: dict[str, float] = {}
        peak = 0
        for t, peer in events:
            last[peer] = t
            peak = max(peak, sum(1 for seen in last.values() if seen > t - window))
        peaks.append(peak)
    return {"max": float(max(peaks, default=0)), "mean": sum(peaks) / len(peaks) if peaks else 0.0,
            "members": float(len(peaks))}


def connection_opens(sends: Sequence[tuple[float, str]], bound: int, keepalive: float,
                     warm_until: float = float("-inf")) -> int:
    """Connections opened to send ``sends`` ((seconds, peer), in time order) through a pool of at
    most ``bound`` connections, each closed ``keepalive`` seconds after its last use; those
    opened at or before ``warm_until`` (the pool filling up) are not counted."""
    pool: OrderedDict[str, float] = OrderedDict()  # peer -> last use, least recent first
    opens = 0
    for t, peer in sends:
        for stale in [p for p, used in pool.items() if used <= t - keepalive]:
            del pool[stale]
        if peer in pool:
            pool.move_to_end(peer)
        else:
            opens += t > warm_until
            if len(pool) >= bound:
                pool.popitem(last=False)
        pool[peer] = t
    return opens
