"""The wire compatibility window: the versions a sidecar speaks, and the one a session uses.

A release speaks every wire version from ``WIRE_OLDEST`` (the previous release's, N-1) to
``WIRE_VERSION`` (its own, N) and refuses a peer that speaks none of them. The handshake's
step 1 states the range (``peers/handshake.py``): the client's body and the server's reply
carry ``"wire_min"`` and ``"wire_max"`` beside ``"wire_version"`` (its ``wire_max``). A side
that states no range, a release before wire 2.2 whose step 1 carries only ``wire_version``,
speaks exactly that version; every release tolerates the fields it does not know in step 1,
so the range costs an older peer nothing. Both sides then take the highest version both speak
(``agree``) and state it, under the proof, as the ``wire_version`` of their step-2 hello: a
hello that states another one (no version in common, or a range altered in transit) is refused
``wire_version_mismatch``, and the diff names both ranges. A session speaks the agreed version
(``Session.peer.wire_version``): an encoder whose frames differ between two versions of the
window writes the agreed one's.

Versions:
- 2.1: hellos carry the model identity (a 2.0 hello states none).
- 2.2: step 1 states the range; no frame changed (2.1 and 2.2 frames are the same bytes).

A change of any frame (data protocol, handshake, directory messages, the local channel) bumps
``WIRE_MINOR`` and re-records the golden frames (``tests/tools/wire_golden_frames.json``; the
command is in docs/how-to/upgrade.md, "Upgrades"); a test fails on a changed frame under an
unchanged version. A release that bumps the minor sets
``WIRE_OLDEST`` to the version of the release before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar import __version__
from kv_offload_sidecar.rejections import clip

WIRE_MAJOR = 2
WIRE_MINOR = 2
WIRE_VERSION = f"{WIRE_MAJOR}.{WIRE_MINOR}"
# The oldest version this release speaks: the previous release's (d0dde59 spoke 2.1 only).
WIRE_OLDEST = "2.1"


def parse_version(version: Any) -> tuple[int, int] | None:
    """``(major, minor)`` of a "major.minor" string; None for anything else."""
    if not isinstance(version, str):
        return None
    parts = version.split(".")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) < 6 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def wire_major(version: Any) -> int | None:
    parsed = parse_version(version)
    return None if parsed is None else parsed[0]


def _text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class WireRange:
    """The wire versions one side speaks, both ends included."""

    # Oldest version spoken (major, minor).
    low: tuple[int, int]
    # Newest version spoken (major, minor): the side's own.
    high: tuple[int, int]

    @classmethod
    def exactly(cls, version: str) -> "WireRange":
        """A side that speaks one version (a release before 2.2, or a hello made for one)."""
        parsed = parse_version(version)
        if parsed is None:
            raise ValueError(f"wire version {clip(repr(version), 64)} is not 'major.minor'")
        return cls(parsed, parsed)

    @property
    def text(self) -> str:
        """``"2.1..2.2"``: as a refusal names it."""
        return f"{_text(self.low)}..{_text(self.high)}"

    def step1(self) -> dict[str, str]:
        """The fields a step 1 (body or reply) states the range with."""
        return {"wire_version": _text(self.high), "wire_min": _text(self.low), "wire_max": _text(self.high)}


# What this release speaks.
SPOKEN = WireRange(parse_version(WIRE_OLDEST) or (0, 0), (WIRE_MAJOR, WIRE_MINOR))


def build_view() -> dict[str, str]:
    """This release and the wire versions it speaks, as ``/v1/status`` shows them (the
    ``kv_offload_build_info{version,wire}`` series says the same)."""
    return {"version": __version__, "wire_version": WIRE_VERSION, "wire_min": WIRE_OLDEST,
            "wire_max": WIRE_VERSION}


def spoken_for(version: str) -> WireRange:
    """The range a side whose hello names ``version`` speaks: this release's for its own
    version, exactly ``version`` for any other (a test's stand-in for another release)."""
    return SPOKEN if version == WIRE_VERSION else WireRange.exactly(version)


def stated_range(body: Mapping[str, Any]) -> WireRange:
    """The range a step-1 body or reply states; ``ValueError`` naming the field if malformed.

    ``wire_version`` must read "major.minor" (the only field a release before 2.2 sends);
    ``wire_min`` and ``wire_max``, when either is present, must both read so, in order.
    """
    version = body.get("wire_version")
    if parse_version(version) is None:
        raise ValueError(f"handshake 'wire_version' {clip(repr(version), 64)} is not 'major.minor'")
    if "wire_min" not in body and "wire_max" not in body:
        return WireRange.exactly(version)
    low, high = parse_version(body.get("wire_min")), parse_version(body.get("wire_max"))
    if low is None or high is None or low > high:
        raise ValueError(f"handshake 'wire_min' {clip(repr(body.get('wire_min')), 32)} and 'wire_max' "
                         f"{clip(repr(body.get('wire_max')), 32)} must read 'major.minor', "
                         f"wire_min <= wire_max")
    return WireRange(low, high)


def agree(mine: WireRange, theirs: WireRange) -> str | None:
    """The highest version both ranges hold; None when they do not overlap."""
    high, low = min(mine.high, theirs.high), max(mine.low, theirs.low)
    return _text(high) if low <= high else None


def wire_diff(local_version: str, remote_version: str,
              ranges: tuple[WireRange, WireRange] | None) -> str | None:
    """The diff line of a wire version mismatch, naming both ranges when known; None: none."""
    if ranges is None:
        if local_version == remote_version:
            return None
        return f"wire_version: {local_version} != {remote_version}"
    mine, theirs = ranges
    agreed = agree(mine, theirs)
    if agreed is None:
        return f"wire_version: speaks {mine.text} != {theirs.text} (no version in common)"
    if remote_version != agreed or local_version != agreed:
        return (f"wire_version: {local_version} (speaks {mine.text}) != {remote_version} "
                f"(speaks {theirs.text})")
    return None


__all__ = ["SPOKEN", "build_view", "WIRE_MAJOR", "WIRE_MINOR", "WIRE_OLDEST", "WIRE_VERSION", "WireRange", "agree",
           "parse_version", "spoken_for", "stated_range", "wire_diff", "wire_major"]
