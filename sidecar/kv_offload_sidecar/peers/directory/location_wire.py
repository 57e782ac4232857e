"""The messages of the chunk directory: publishes to owners and owner queries, as data.

A chunk key stands for itself in the directory as an 8-byte digest
(``blake2b(key, digest_size=8)``, an int here). Two messages travel between
sidecars, each a JSON body POSTed on the control port with the HMAC of the
sender's session key (``location_auth``):

- ``PublishBatch`` (``/v1/publish``), holder -> owner: digests the holder
  gained (each with the 4-byte *tail*: the low 32 bits of the digest of the
  last key of the chain it came in), those it copied from a peer apart (its
  store evicts them first, so owners name them last), and digests it lost,
  numbered per (holder, owner)
  stream; ``reset`` replaces everything the owner had from the holder;
  ``resync_me`` asks the receiver for its own full share. Answered by
  ``PublishReply``.
- ``LocateQuery`` (``/v1/locate``), querier -> owner: the digest looked for
  and the digests of the keys after it in the request (the owner ranks
  holders whose tail lies deepest in them). Answered by ``LocateReply``:
  holders, best first, each with the run of keys its tail claims.

Every ``from_dict`` validates and raises ``ValueError`` saying what is wrong;
every list is bounded, so one message's memory is bounded too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any

# Bytes of a chunk digest on the wire.
DIGEST_BYTES = 8
# Bytes of a tail on the wire.
TAIL_BYTES = 4
# Mask of a tail (the low 32 bits of a digest).
TAIL_MASK = (1 << 32) - 1
# Most records (adds + copies + removes) in one publish message (keeps bodies under 256 KiB).
MAX_PUBLISH_RECORDS = 12288
# Most digests in one locate query.
MAX_LOCATE_DIGESTS = 256
# Most holders in one locate reply.
MAX_LOCATE_HOLDERS = 8
# Longest identity accepted in a reply.
MAX_IDENTITY_CHARS = 256
_EPOCH = re.compile(r"^[0-9a-f]{1,64}$")


def key_digest(key: bytes) -> int:
    """The 8-byte digest (as an int) that stands for a chunk key in the directory."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest(), "big")


def tail_of(digest: int) -> int:
    """The 4-byte tail that names a chain's last key in a publish."""
    return digest & TAIL_MASK


def location_auth(session_key: bytes, op: str, body: bytes) -> str:
    """HMAC proving a publish or locate body comes from an authenticated session."""
    return hmac.new(session_key, b"kv-offload location\x00" + op.encode() + b"\x00" + body,
                    hashlib.sha256).hexdigest()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any, what: str, record: int, limit: int) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError(f"{what} is not valid base64") from None
    if len(raw) % record:
        raise ValueError(f"{what} holds {len(raw)} bytes, not a multiple of {record}")
    if len(raw) // record > limit:
        raise ValueError(f"{what} holds more than {limit} records")
    return raw


def pack_digests(digests: tuple[int, ...] | list[int]) -> str:
    return _b64(b"".join(d.to_bytes(DIGEST_BYTES, "big") for d in digests))


def unpack_digests(text: Any, what: str = "digest list", limit: int = MAX_PUBLISH_RECORDS) -> tuple[int, ...]:
    raw = _unb64(text, what, DIGEST_BYTES, limit)
    return tuple(int.from_bytes(raw[i:i + DIGEST_BYTES], "big") for i in range(0, len(raw), DIGEST_BYTES))


def pack_adds(adds: tuple[tuple[int, int], ...]) -> str:
    return _b64(b"".join(d.to_bytes(DIGEST_BYTES, "big") + t.to_bytes(TAIL_BYTES, "big") for d, t in adds))


def unpack_adds(text: Any, what: str = "adds") -> tuple[tuple[int, int], ...]:
    size = DIGEST_BYTES + TAIL_BYTES
    raw = _unb64(text, what, size, MAX_PUBLISH_RECORDS)
    return tuple((int.from_bytes(raw[i:i + DIGEST_BYTES], "big"),
                  int.from_bytes(raw[i + DIGEST_BYTES:i + size], "big")) for i in range(0, len(raw), size))


def _flag(d: dict[str, Any], name: str) -> bool:
    value = d.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"publish {name} must be a boolean")
    return value


@dataclass(frozen=True)
class PublishBatch:
    """Changes of one holder's chunks, for one owner (one message of their stream)."""

    # Names the holder's process lifetime (hex); a new epoch (a restart) must come with reset.
    epoch: str
    # Position in the (holder, owner) stream: 1 + the previous message's seq.
    seq: int
    # True: the owner drops what it had from this holder first (the holder's full share follows).
    reset: bool
    # True: the sender holds nothing of the receiver's and asks for the receiver's full share.
    resync_me: bool
    # (digest, tail) of chunks the holder gained (or whose chain tail changed).
    adds: tuple[tuple[int, int], ...]
    # Digests of chunks the holder lost.
    removes: tuple[int, ...]
    # (digest, tail) of chunks the holder copied from a peer (demoted in its store).
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def records(self) -> int:
        return len(self.adds) + len(self.copies) + len(self.removes)

    def to_dict(self) -> dict[str, Any]:
        d = {"epoch": self.epoch, "seq": self.seq, "reset": self.reset, "resync_me": self.resync_me,
             "adds": pack_adds(self.adds), "removes": pack_digests(self.removes)}
        if self.copies:
            d["copies"] = pack_adds(self.copies)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> PublishBatch:
        if not isinstance(d, dict):
            raise ValueError("publish body must be a JSON object")
        epoch, seq = d.get("epoch"), d.get("seq")
        if not isinstance(epoch, str) or not _EPOCH.match(epoch):
            raise ValueError("publish epoch must be 1-64 lower-case hex digits")
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < 1 << 62:
            raise ValueError("publish seq must be a positive integer")
        adds, removes = unpack_adds(d.get("adds")), unpack_digests(d.get("removes"), "removes")
        copies = unpack_adds(d["copies"], "copies") if "copies" in d else ()
        if len(adds) + len(copies) + len(removes) > MAX_PUBLISH_RECORDS:
            raise ValueError(f"publish holds more than {MAX_PUBLISH_RECORDS} records: split it")
        return cls(epoch, seq, _flag(d, "reset"), _flag(d, "resync_me"), adds, removes, copies)


@dataclass(frozen=True)
class PublishReply:
    """An owner's answer to a publish."""

    # True: the owner did not apply it (a gap in the stream, or no state for the holder);
    # the holder sends its full share (reset) next.
    resync: bool

    def to_dict(self) -> dict[str, Any]:
        return {"resync": self.resync}

    @classmethod
    def from_dict(cls, d: Any) -> PublishReply:
        if not isinstance(d, dict) or not isinstance(d.get("resync"), bool):
            raise ValueError("publish reply must be {\"resync\": bool}")
        return cls(d["resync"])


@dataclass(frozen=True)
class LocateQuery:
    """Which peers hold ``digests[0]``; the rest are the keys after it in the request."""

    # Digests of the request's keys from the first one not held locally, in order (>= 1).
    digests: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"digests": pack_digests(self.digests)}

    @classmethod
    def from_dict(cls, d: Any) -> LocateQuery:
        if not isinstance(d, dict):
            raise ValueError("locate body must be a JSON object")
        digests = unpack_digests(d.get("digests"), "digests", MAX_LOCATE_DIGESTS)
        if not digests:
            raise ValueError("locate digests must name at least one key")
        return cls(digests)


@dataclass(frozen=True)
class HolderClaim:
    """One holder named by an owner."""

    # The holder's identity (as its handshake gave it).
    identity: str
    # Keys from digests[0] on that the holder's published tail covers (>= 1; a hint, not a promise).
    run: int


@dataclass(frozen=True)
class LocateReply:
    """An owner's answer to a locate: holders of the key, best first."""

    # At most MAX_LOCATE_HOLDERS holders.
    holders: tuple[HolderClaim, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"holders": [[h.identity, h.run] for h in self.holders]}

    @classmethod
    def from_dict(cls, d: Any) -> LocateReply:
        items = d.get("holders") if isinstance(d, dict) else None
        if not isinstance(items, list) or len(items) > MAX_LOCATE_HOLDERS:
            raise ValueError(f"locate reply must be {{\"holders\": [[identity, run], ...]}} with at most "
                             f"{MAX_LOCATE_HOLDERS} holders")
        out = []
        for item in items:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or not 0 < len(item[0]) <= MAX_IDENTITY_CHARS or isinstance(item[1], bool)
                    or not isinstance(item[1], int) or not 0 < item[1] <= MAX_LOCATE_DIGESTS):
                raise ValueError("locate reply holders must be [identity, run >= 1] pairs")
            out.append(HolderClaim(item[0], item[1]))
        return cls(tuple(out))
