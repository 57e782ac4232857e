"""The tier's bookkeeping records: a key's lookup state, a transfer job, a lookup's hit prefix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kv_offload_sidecar.engine.vllm_contract import Locality


@dataclass
class KeyState:
    submitted: float
    # None while unanswered, then True (present) or False (absent, failed or refused).
    result: bool | None = None
    request_ids: set[str] = field(default_factory=set)
    # The sidecar's time.monotonic() when it knew the answer (None: not said, or no answer).
    known_at: float | None = None


@dataclass
class Job:
    kind: str  # "load" or "store"
    job_id: int
    keys: list[bytes]
    rows: list[int]
    submitted: float
    # vLLM's ReqContext of the job's request (what a stored chunk's event names, 0.34 on).
    req_context: Any = None


def locality_of(value: Any) -> Locality:
    try:
        return value if isinstance(value, Locality) else Locality(str(value).upper())
    except ValueError:
        raise ValueError(f"kv-offload tier: locality {value!r} is not one of "
                         f"{[m.value for m in Locality]}") from None


def hit_prefix(reply: Any, n: int) -> tuple[int, int]:
    """(leading keys held locally, leading keys held locally or by a peer) of a LookupReply.

    ``reply.local`` keys are in this pod's store and the next ``reply.peer`` on a peer.
    """
    local = max(0, min(int(reply.local), n))
    total = max(local, min(local + int(reply.peer), n))
    return local, total


__all__ = ["Job", "KeyState", "hit_prefix", "locality_of"]
