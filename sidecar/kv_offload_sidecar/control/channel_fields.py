"""The fields of a local-channel request, checked: each bad field is a ``ChannelError`` that
names it, what it holds and what it must be (the contract of the ops is ``control.local_channel``).
"""

from __future__ import annotations

import time
from typing import Any

from kv_offload_sidecar.engine import channel_protocol as cp
from kv_offload_sidecar.store.engine_region import EngineRegion, RegionError

# Longest job id a request may carry (characters).
MAX_JOB_ID_CHARS = 64


class ChannelError(Exception):
    """A bad request: answered with its message; ``fatal`` closes the connection."""

    def __init__(self, message: str, *, fatal: bool = False, reason: str = "malformed",
                 stale: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal
        self.reason = reason
        # True when the request names another sidecar instance (the engine must re-attach).
        self.stale = stale


def keys_of(req: dict[str, Any]) -> list[bytes]:
    try:
        return cp.decode_keys(req.get("keys"))
    except OverflowError as exc:
        raise ChannelError(str(exc), reason="oversize") from None
    except KeyError as exc:
        raise ChannelError(exc.args[0], reason="bad_key") from None
    except ValueError as exc:
        raise ChannelError(str(exc)) from None


def timeout_of(req: dict[str, Any], default: float) -> float:
    t = req.get("timeout", default)
    limit = cp.MAX_TIMEOUT_SECONDS
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= limit:
        raise ChannelError(f"'timeout' must be seconds in (0, {limit}], got {t!r}")
    return float(t)


def deadline_of(req: dict[str, Any]) -> float:
    """The request's ``deadline`` (``time.monotonic()`` seconds), at most MAX_TIMEOUT_SECONDS ahead."""
    d = req.get("deadline")
    now = time.monotonic()
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not d <= now + cp.MAX_TIMEOUT_SECONDS:
        raise ChannelError(f"'deadline' must be a time.monotonic() value at most "
                           f"{cp.MAX_TIMEOUT_SECONDS} s ahead, got {d!r}")
    return float(d)


def rows_of(region: EngineRegion, req: dict[str, Any], count: int) -> list[int]:
    try:
        return region.check_rows(req.get("rows"), count)
    except RegionError as exc:
        raise ChannelError(str(exc)) from None


def flag_of(req: dict[str, Any], name: str) -> bool:
    """The request's optional boolean field ``name`` (absent: False)."""
    v = req.get(name, False)
    if not isinstance(v, bool):
        raise ChannelError(f"'{name}' must be true or false, got {v!r}")
    return v


def job_of(req: dict[str, Any]) -> str | None:
    """The request's optional ``job`` id (what ``cancel`` names)."""
    job = req.get("job")
    if job is not None and (not isinstance(job, str) or not 0 < len(job) <= MAX_JOB_ID_CHARS):
        raise ChannelError(f"'job' must be a string of 1..{MAX_JOB_ID_CHARS} characters")
    return job


def id_of(req: dict[str, Any]) -> int:
    v = req.get("id")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ChannelError("'id' must be the integer returned by reserve/load")
    return v
