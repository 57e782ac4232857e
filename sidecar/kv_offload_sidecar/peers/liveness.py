"""Liveness of a peer link, and how long a request waits for a peer's first answer.

Rules (each with its detection time; the TCP ones are in ``keepalive``, the servers' in
``data.serving``):

- **Heartbeat.** A link with an open data connection (``data_links``: opened on demand,
  closed after ``data_links.DATA_IDLE_SECONDS`` without an exchange) pings every connection
  of it (every lane) each ``HEARTBEAT_SECONDS``: an empty LOOKUP, a frame every plane's
  server already answers on the authenticated connection (``FramedPeerDataClient.ping``). A ping fails when *nothing*
  came from the peer on that connection for ``LOST_AFTER_SECONDS`` after it left (a pong
  queued behind chunks still arriving is no failure), and then the link is lost: it
  leaves the membership and reconnects. A peer cut off silently is declared lost within
  ``HEARTBEAT_SECONDS + LOST_AFTER_SECONDS`` (1.0 s), with or without requests to it.
- **Probe.** A member with no data connection open is not pinged. A failed data open or
  location call (a publish to it, a locate) reports it lost (``links.PeerManager.call``), and
  one heard nothing from (no exchange, no call answered) for ``MEMBER_PROBE_SECONDS`` is asked
  one locate (``PROBE_TIMEOUT_SECONDS`` at most): a member gone without a data connection is
  dropped within ``probe_period`` + ``PROBE_TIMEOUT_SECONDS``: 7 s up to 21 peers, then
  growing with the pool (10 s at 32, 258 s at 1,024), since a sidecar sends at most
  ``MEMBER_PROBES_PER_SECOND`` probes (4) a second: an idle sidecar's calls, and the control
  connections they hold (each closes ``CONTROL_KEEPALIVE_SECONDS`` after its call), do not grow
  with the pool. A busy pool's publishes and reads stand in for most probes, and a member
  asked for anything is dropped at its first failed call.
- **Answer deadline.** Each pong is a round-trip sample (``RoundTrips``: RFC 6298's smoothed
  round trip and deviation); so is each location call answered while no data connection is open
  (a probe, a publish, a locate). A request waits for a peer's first answer (an owner's locate,
  a holder's count) only while the peer is heard from: it gives up once nothing came from that
  peer for ``answer_silence()`` = max(``ANSWER_FLOOR_SECONDS``, ``ANSWER_RTT_FACTOR`` x (srtt +
  4 x rttvar)) since it asked, bounded by the fetch deadline (the whole fetch deadline before
  the first sample). Giving up is a miss, not a failure: the exchange itself runs on to the
  fetch deadline in the background (bulk bytes may take long), and the heartbeat, not one late
  answer, decides that the peer is lost. A request waits one silence per peer, not one per
  question: a holder that is also the chunks' primary owner, and left the request's owner
  question unanswered (the runner-up named it), is judged from that question while nothing came
  from it after (``since``); beside the question goes a ping (``pong``) on that owner's open
  data link, one in flight per owner, so an owner alive but slow to answer (or whose control port
  drops the question) shows it by its pong and its count gets a silence of its own. While the
  peer's data link opens, a request waits ``OPEN_ROUND_TRIPS`` answer silences, and once the
  open reached the holder's host (its TCP connection made, ``data.connect``'s ``reached``; on
  UCX, whose endpoint makes none, the one it dials beside to the holder's control port) the
  open's own bound judges the peer instead (``last_heard``: the handshake timeout, and a failed
  open reports it): the proof's round trips need the holder's process, slower on a loaded host
  than a warm link's one, and a pod's first exchange with a holder is the one that brings its
  first peer hit (a real-vLLM demo under a busy core missed it in 4 runs of 5 when the open
  counted as silence). A request that touches a silently cut peer before the heartbeat noticed
  pays about ``ANSWER_FLOOR_SECONDS`` (50 ms) at a small round trip, as owner and holder at once
  too, ``OPEN_ROUND_TRIPS`` times that when its data link must open first; after, none (the peer
  is no member and no holder).
- **Heal.** A link lost to liveness or unreachable backs off below at most
  ``HEAL_BACKOFF_MAX_SECONDS`` (full jitter; rejections keep
  ``PeerSettings.backoff_max_seconds``), and the peer's handshake to us ends our wait
  (``PeerManager.wake``), so a healed peer is connected again within 5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv_offload_sidecar.data.peer_client import AnswerGivenUp, answer_or_silence

__all__ = ["ANSWER_FLOOR_SECONDS", "AnswerGivenUp", "HEARTBEAT_SECONDS", "LOST_AFTER_SECONDS", "MEMBER_PROBE_SECONDS",
           "MEMBER_PROBES_PER_SECOND", "probe_period",
           "OPEN_ROUND_TRIPS", "PROBE_TIMEOUT_SECONDS", "RoundTrips",
           "answer_or_silence", "backoff_cap", "backoff_delay", "heartbeat", "last_heard", "pong"]

# Seconds between heartbeats of a connected link.
HEARTBEAT_SECONDS = 0.25
# Seconds without any frame from the peer after a heartbeat left before the link is lost.
LOST_AFTER_SECONDS = 0.75
# Least silence a request waits through for a peer's first answer (seconds).
ANSWER_FLOOR_SECONDS = 0.05
# How many times the peer's round-trip bound (srtt + 4 rttvar) a request waits through.
ANSWER_RTT_FACTOR = 2.0
# Seconds without hearing from a member with no data connection before it is probed.
MEMBER_PROBE_SECONDS = 5.0
# Most probes a sidecar sends a second, whatever the pool's size (``probe_period``).
MEMBER_PROBES_PER_SECOND = 4.0
# Seconds a probe of such a member may take before the member is lost.
PROBE_TIMEOUT_SECONDS = 2.0
# How many answer silences a request waits through while the peer's data link opens (the
# connection, the server's nonce, the proof, then the answer).
OPEN_ROUND_TRIPS = 4
# Cap of the back-off delay of a link lost to liveness or unreachable (seconds).
HEAL_BACKOFF_MAX_SECONDS = 2.0


def probe_period(others: int) -> float:
    """Seconds between two probes of one quiet member beside ``others`` peers: at least
    ``MEMBER_PROBE_SECONDS``, stretched so all probes stay within ``MEMBER_PROBES_PER_SECOND``."""
    return max(MEMBER_PROBE_SECONDS, others / MEMBER_PROBES_PER_SECOND)


def backoff_delay(failures: int, initial: float, maximum: float,
                  draw: Callable[[], float] = random.random) -> float:
    """Seconds to wait after ``failures`` consecutive failures: full jitter, a uniform draw below
    ``initial * 2 ** (failures - 1)`` capped at ``maximum``."""
    return draw() * min(maximum, initial * 2 ** (failures - 1))


def backoff_cap(state: str, maximum: float) -> float:
    """The largest back-off cap of a link in ``state``: ``maximum`` for a rejecting peer (a
    rollout may fix it), ``HEAL_BACKOFF_MAX_SECONDS`` at most for a lost or unreachable one,
    so a healed partition is seen within 5 s (``liveness``)."""
    return maximum if state == "rejected" else min(maximum, HEAL_BACKOFF_MAX_SECONDS)


def last_heard(link: Any) -> float:
    """When the peer of ``link`` (a ``links.PeerLink``) was last heard on its data link, for
    ``answer_or_silence``: now while that link opens past the point where it reached the
    holder's host (its TCP connection made: the holder's process may be slow, and the open's
    own bound judges it), 0.0 before that (a host cut off never gets there) and while it has
    none."""
    if link.data is not None:
        return link.data.heard_at
    return time.monotonic() if link.opening is not None and link.open_reached else 0.0


class RoundTrips:
    """A peer's smoothed round trip and its deviation (RFC 6298), from heartbeat samples."""

    def __init__(self) -> None:
        # Smoothed round trip (seconds); None before the first sample.
        self.srtt: float | None = None
        # Smoothed deviation of the round trip (seconds).
        self.rttvar = 0.0

    def observe(self, seconds: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
            self.srtt = 0.875 * self.srtt + 0.125 * seconds

    def answer_silence(self, cap: float) -> float:
        """Seconds a request waits through without a frame from the peer (see the module)."""
        if self.srtt is None:
            return cap
        return min(cap, max(ANSWER_FLOOR_SECONDS, ANSWER_RTT_FACTOR * (self.srtt + 4 * self.rttvar)))


def lanes_of(client: Any) -> Sequence[Any]:
    """The connections behind a data client (its control connection and lanes, or itself)."""
    return getattr(client, "connections", None) or [client]


async def pong(client: Any, round_trips: RoundTrips) -> None:
    """One ping on a peer's data client beside a question to the peer (``peer_reads``: an owner's
    locate), so an alive peer is heard from after the question even when its answer is slow; the
    pong a round-trip sample. A silent one fails the connection as a heartbeat's does (the
    link's watch then finds it closed)."""
    with contextlib.suppress(Exception):
        round_trips.observe(await client.ping(LOST_AFTER_SECONDS))


async def heartbeat(client: Any, round_trips: RoundTrips) -> None:
    """One heartbeat on every connection of ``client``; each pong a round-trip sample.
    ``TransportError`` (the connection failed) when a connection went silent."""
    rtts = await asyncio.gather(*(lane.ping(LOST_AFTER_SECONDS) for lane in lanes_of(client)))
    for rtt in rtts:
        round_trips.observe(rtt)
