"""vLLM's secondary-tier contract: its own classes inside vLLM, same-shaped stand-ins outside.

Inside vLLM (0.32, 0.33 and 0.34, the releases kv-offload supports) the tier must
subclass vLLM's ``SecondaryTierManager`` and exchange vLLM's own types, so
this module re-exports them from ``vllm.v1.kv_offload``. Outside vLLM (the
simulated engine, the demo, unit tests) it defines stand-ins with the same
names, fields and constructor signature as vLLM 0.34's, so the tier runs
unchanged; the stand-ins are never proof of compatibility (the real-vLLM
tests are: tests/vllm/test_vllm_tiering_manager.py drives 0.33's and 0.34's
managers, test_real_vllm_engines 0.32's engines).

What differs between the releases, and how the tier meets each:
- ``JobResult.deferred_release`` (0.34): a failed promotion whose I/O may still write
  into vLLM's rows carries an event; vLLM keeps the rows out of reuse until it is set,
  and ``drain_jobs`` must set every such event before it returns. ``DEFERRED_RELEASE``
  says whether vLLM's ``JobResult`` has it (``tier_transfers``, ``tier_releases``);
  without it a failed load is reported as before.
- ``OffloadingEvent.req_context`` (0.34): the request a stored event came from;
  ``EVENT_REQ_CONTEXT`` says whether it exists (the tier fills it then).
- ``SecondaryTierManager.touch`` is gone in 0.34 (0.32/0.33's base class keeps a no-op,
  which the tier inherits); ``ReqContext`` gained token counts the tier does not read;
  ``CacheHitSource`` is a ``StrEnum`` (its values are unchanged).
- Constructor, the six abstract methods, ``LookupResult``, ``drain_jobs``, ``shutdown``
  and ``reset_cache`` are as in 0.33; the primary region file is still
  ``/dev/shm/vllm_offload_{engine_id}.mmap``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

try:
    from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found]
        JobResult,
        SecondaryTierManager,
        TransferJob,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]

    VLLM_AVAILABLE = True
except ImportError:
    VLLM_AVAILABLE = False

    class LookupResult(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's LookupResult."""

        MISS = enum.auto()
        HIT = enum.auto()
        HIT_PENDING = enum.auto()
        RETRY = enum.auto()

    class Medium(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's Medium."""

        CPU = "CPU"
        STORAGE = "STORAGE"

    class Locality(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's Locality."""

        LOCAL = "LOCAL"
        REMOTE = "REMOTE"

    class CacheHitSource(str, enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's CacheHitSource."""

        DEVICE = "device"
        HOST = "host"
        P2P = "p2p"
        DISK = "disk"
        EXTERNAL_UNSPECIFIED = "external_unspecified"

    @dataclass(frozen=True)
    class OffloadingCounterMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's OffloadingCounterMetadata."""

        documentation: str
        labelnames: tuple[str, ...] = ()

    @dataclass(frozen=True)
    class OffloadingGaugeMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's OffloadingGaugeMetadata."""

        documentation: str
        labelnames: tuple[str, ...] = ()
        multiprocess_mode: str = "mostrecent"

    @dataclass
    class OffloadingEvent:  # type: ignore[no-redef]
        """Stand-in for vLLM's OffloadingEvent."""

        keys: list[bytes]
        medium: Medium
        removed: bool
        locality: Locality | None = None
        ownership: str | None = None
        removal_expected: bool = False
        metadata_only: bool = False
        req_context: Any = field(default=None, repr=False, compare=False)

    @dataclass
    class RequestOffloadingContext:  # type: ignore[no-redef]
        """Stand-in for vLLM's RequestOffloadingContext."""

        policy: str = "chunk_level"

    @dataclass
    class ReqContext:  # type: ignore[no-redef]
        """Stand-in for vLLM's ReqContext."""

        req_id: str
        kv_transfer_params: dict[str, Any] | None = None

    @dataclass
    class TransferJob:  # type: ignore[no-redef]
        """Stand-in for vLLM's TransferJob: chunk_ids are primary-tier rows."""

        job_id: int
        keys: Collection[bytes]
        chunk_ids: np.ndarray
        is_promotion: bool
        req_context: ReqContext
        submit_time: float = 0.0

    @dataclass
    class JobResult:  # type: ignore[no-redef]
        """Stand-in for vLLM's JobResult."""

        job_id: int
        success: bool
        successful_keys: Collection[bytes] | None = None
        transfer_time: float | None = None
        transfer_bytes: int | None = None
        deferred_release: threading.Event | None = None

    class SecondaryTierManager(ABC):  # type: ignore[no-redef]
        """Stand-in for vLLM's SecondaryTierManager (vLLM 0.34's: no ``touch``)."""

        medium: ClassVar[Medium | None] = None
        cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
        tolerates_off_thread_polling: ClassVar[bool] = False

        def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                     tier_type: str, backpressure_detector: Any = None) -> None:
            self._offloading_spec = offloading_spec
            self._primary_kv_view = primary_kv_view
            self._block_size_bytes = primary_kv_view.strides[0]
            self.tier_type = tier_type
            self.locality: Locality | None = None
            self._bp_detector = backpressure_detector

        @property
        def block_size_bytes(self) -> int:
            return self._block_size_bytes

        @property
        def bp_detector(self) -> Any:
            return self._bp_detector

        @abstractmethod
        def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

        @abstractmethod
        def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult: ...

        @abstractmethod
        def submit_store(self, job_metadata: TransferJob) -> None: ...

        @abstractmethod
        def submit_load(self, job_metadata: TransferJob) -> None: ...

        @abstractmethod
        def get_finished_jobs(self) -> Iterable[JobResult]: ...

        @abstractmethod
        def drain_jobs(self) -> None: ...

        def shutdown(self) -> None:
            return None


# Whether vLLM's JobResult carries deferred_release (0.34 on) and its OffloadingEvent
# req_context (0.34 on).
DEFERRED_RELEASE = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}
EVENT_REQ_CONTEXT = "req_context" in {f.name for f in dataclasses.fields(OffloadingEvent)}


def tier_logger(name: str) -> logging.Logger:
    """The tier's logger: inside vLLM a child of vLLM's, so its lines appear in vLLM's log."""
    return logging.getLogger(f"vllm.{name}" if VLLM_AVAILABLE else name)


def vllm_hash_seed() -> str | None:
    """The seed vLLM derives its prefix hashes from in this process, or None if unknown.

    Inside vLLM this is what vLLM resolved (``PYTHONHASHSEED``, or vLLM's fixed
    default for sha256 when it is unset); outside vLLM only ``PYTHONHASHSEED``
    is known.
    """
    if VLLM_AVAILABLE:
        try:
            from vllm.v1.core.kv_cache_utils import get_none_hash_seed  # type: ignore
            return str(get_none_hash_seed())
        except ImportError:
            pass
    return os.environ.get("PYTHONHASHSEED")


def connector_stats() -> Any:
    """A fresh ``OffloadingConnectorStats`` of vLLM's, or None outside vLLM."""
    if not VLLM_AVAILABLE:
        return None
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore
            OffloadingConnectorStats,
        )
    except ImportError:
        return None
    return OffloadingConnectorStats()


def current_vllm_config() -> Any:
    """The ``VllmConfig`` vLLM set as current in this process, or None (outside vLLM, or unset)."""
    if not VLLM_AVAILABLE:
        return None
    try:
        from vllm.config import get_current_vllm_config_or_none  # type: ignore
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def vllm_platform() -> Any:
    """vLLM's ``current_platform`` (the device the engine runs on), or None outside vLLM."""
    if not VLLM_AVAILABLE:
        return None
    try:
        from vllm.platforms import current_platform  # type: ignore
    except ImportError:
        return None
    return current_platform


def vllm_version() -> str:
    """The vLLM release this process runs ("0.32.0"), or "" outside vLLM."""
    if not VLLM_AVAILABLE:
        return ""
    from vllm import __version__  # type: ignore
    return str(__version__)


__all__ = [
    "CacheHitSource", "DEFERRED_RELEASE", "EVENT_REQ_CONTEXT", "JobResult", "Locality", "LookupResult", "Medium",
    "OffloadingCounterMetadata", "OffloadingEvent", "OffloadingGaugeMetadata", "ReqContext",
    "RequestOffloadingContext", "SecondaryTierManager", "TransferJob", "VLLM_AVAILABLE",
    "connector_stats", "current_vllm_config", "tier_logger", "vllm_hash_seed", "vllm_platform",
    "vllm_version",
]
