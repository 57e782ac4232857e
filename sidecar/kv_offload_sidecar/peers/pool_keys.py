"""The pool's keys as this sidecar holds them right now, and what is derived from them.

A pool key rotates without downtime: the operator moves the current key to
``previous-key`` and writes a new ``key`` into the pool Secret; kubelet updates
the mounted files in place, pod by pod. A sidecar re-reads the files every
``key_reload_seconds`` and accepts either key while both are present; in a
handshake the two sides agree on the first key id of the initiator's list that
the responder also holds (``choose``), so an updated and a not yet updated pod
still share a key. Once ``previous-key`` is gone, sessions made with it end
(``dropped``) and their peers handshake again with the current key.

Derived values (never the key itself) cross the wire or reach users:

- ``key_id(key)``: 8 bytes naming a key in a handshake (HMAC, reveals nothing).
- ``admin_token(key)``: the bearer token of the admin endpoints for holders of
  the pool key (``kv-offload admin-token --pool-key-file F`` prints it).
- ``hkdf(key, salt, info)``: RFC 5869 HKDF-SHA256 of the session keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

log = logging.getLogger(__name__)

KEY_ID_BYTES = 8
# Most key ids an initiator may offer (current and previous, with room to spare).
MAX_OFFERED_KEYS = 4
_KEY_ID_LABEL = b"kv-offload key id v1"
_ADMIN_LABEL = b"kv-offload admin token v1"


def hkdf(key: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869, cryptography's): extract with ``salt``, expand with ``info``."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt or None, info=info).derive(key)


def key_id(key: bytes) -> bytes:
    """The public name of a pool key in handshakes."""
    return hmac.new(key, _KEY_ID_LABEL, hashlib.sha256).digest()[:KEY_ID_BYTES]


def admin_token(key: bytes) -> str:
    """The admin bearer token derived from a pool key (hex)."""
    return hmac.new(key, _ADMIN_LABEL, hashlib.sha256).hexdigest()


def load_pool_key(path: str) -> bytes:
    """Read the pool key file (the Secret's key, mounted as a file).

    Surrounding whitespace is stripped. Raises ``ValueError`` naming the file
    and what to do when it is missing, unreadable or empty.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 20)
    except FileNotFoundError:
        raise ValueError(
            f"pool key file {path!r} does not exist: mount the pool's Secret there "
            f"or pass --pool-key-file with its path") from None
    except OSError as exc:
        raise ValueError(
            f"pool key file {path!r} is unreadable ({exc.strerror}): "
            f"make it readable by the sidecar's user") from None
    key = data.strip()
    if not key:
        raise ValueError(
            f"pool key file {path!r} is empty: it must hold the pool's secret key "
            f"(the operator writes it into the pool's Secret)")
    return key


def load_optional_key(path: str) -> bytes:
    """A key or token file's stripped bytes; b"" when no path is given, the file is absent or empty.

    An unreadable file is a ValueError naming it (a missing one is not: the
    Secret simply has no previous key)."""
    if not path:
        return b""
    try:
        with open(path, "rb") as fh:
            return fh.read(1 << 20).strip()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise ValueError(f"key file {path!r} is unreadable ({exc.strerror}): "
                         f"make it readable by the sidecar's user") from None


class PoolKeys:
    """Current and previous pool key plus the admin token, re-read from their files."""

    def __init__(self, current: bytes, previous: bytes = b"", admin: bytes = b"", *,
                 current_file: str = "", previous_file: str = "", admin_file: str = "") -> None:
        if not current:
            raise ValueError("the pool key is empty: point --pool-key-file at the pool's Secret key file")
        self._files = (current_file, previous_file, admin_file)
        self._set(current, previous, admin)

    def _set(self, current: bytes, previous: bytes, admin: bytes) -> None:
        self.current = current
        self.previous = previous if previous != current else b""
        self.admin = admin
        self._by_id = {key_id(k): k for k in (self.current, self.previous) if k}
        self._admin_tokens = [admin_token(k) for k in (self.current, self.previous) if k]
        if admin:
            self._admin_tokens.append(admin.decode("utf-8", "replace"))

    def offered_ids(self) -> list[bytes]:
        """Key ids an initiator offers, current first."""
        return [key_id(k) for k in (self.current, self.previous) if k]

    def key(self, kid: bytes) -> bytes | None:
        """The held key with id ``kid``, or None."""
        return self._by_id.get(bytes(kid))

    def choose(self, offered: list[bytes]) -> bytes | None:
        """Responder side: the id of the key to use, given the initiator's ids in its order.

        The responder's current key wins when the initiator holds it too."""
        held = [kid for kid in offered if kid in self._by_id]
        if not held:
            return None
        cur = key_id(self.current)
        return cur if cur in held else held[0]

    def holds(self, kid: bytes) -> bool:
        return bytes(kid) in self._by_id

    def admin_allowed(self, token: str) -> bool:
        """``token`` is a valid admin bearer token (constant-time per candidate)."""
        ok = False
        for t in self._admin_tokens:
            ok |= hmac.compare_digest(token.encode("utf-8", "replace"), t.encode("utf-8", "replace"))
        return ok

    def reload(self) -> list[bytes]:
        """Re-read the files; returns the ids of keys no longer held (sessions to end).

        A current-key file that is missing or empty keeps the key in use (a
        Secret update replaces files atomically, so this only happens when the
        mount is broken) and logs a warning."""
        current_file, previous_file, admin_file = self._files
        if not current_file:
            return []
        try:
            current = load_optional_key(current_file)
            previous = load_optional_key(previous_file)
            admin = load_optional_key(admin_file) if admin_file else self.admin
        except ValueError as exc:
            log.warning("keeping the pool keys in use: %s", exc)
            return []
        if not current:
            log.warning("pool key file %r is missing or empty; keeping the key in use", current_file)
            return []
        if (current, previous, admin) == (self.current, self.previous, self.admin):
            return []
        before, admin_changed = set(self._by_id), admin != self.admin
        self._set(current, previous, admin)
        gone = [kid for kid in before if kid not in self._by_id]
        log.info("pool keys reloaded: %d key(s) held, %d retired%s", len(self._by_id), len(gone),
                 ", admin token changed" if admin_changed else "")
        return gone
