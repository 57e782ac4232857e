"""The tier's link to its pod's sidecar: connect lazily, check the sidecar serves this engine, drop it if not.

Fail closed: at each (re)attachment the link compares the sidecar's
fingerprint, chunk size and hash seed (its local channel's ``info``) with the
config vLLM handed the tier and the seed vLLM resolved, and states the engine's
model identity, which the sidecar compares (and refuses); on any difference it
logs one error line naming the fields, hands out no client (every lookup is a
miss, nothing is stored) and checks again every ``RECHECK_SECONDS``.

Never needed to start or serve: while no sidecar answers (none injected, not
started yet, crashed, its ConfigMap or Secret gone) the link is *detached*: it
hands out no client, so every lookup is an immediate miss and every store is
skipped (vLLM recomputes), logs one warning naming the reason (``DETACHED_*``)
and what to do, tries again every ``RECONNECT_SECONDS``, and logs one info line
when a sidecar attaches. The reason is ``detached`` (None while attached), and
``vllm:kv_offload_tier_detached{reason}`` in vLLM's metrics (``tier_stats``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.engine.sidecar_match import mismatches, refusal_message
from kv_offload_sidecar.engine.vllm_identity import this_engine_identity
from kv_offload_sidecar.engine.vllm_contract import tier_logger, vllm_hash_seed

logger = tier_logger(__name__)

# Seconds between checks of a refused sidecar.
RECHECK_SECONDS = 2.0
# Seconds between attempts to reach a sidecar that is away.
RECONNECT_SECONDS = 1.0
# Why a tier runs detached: vLLM's environment names no sidecar (the pod was not injected:
# no kv-offload label, webhook down with failurePolicy Ignore), or nothing answers at the
# address it names (sidecar not started, crashed, its ConfigMap or Secret gone), or what
# answers is not a kv-offload sidecar / fails the attachment.
DETACHED_NOT_INJECTED = "not_injected"
DETACHED_NO_SIDECAR = "no_sidecar"
DETACHED_SIDECAR_ERROR = "sidecar_error"
DETACHED_REASONS = (DETACHED_NOT_INJECTED, DETACHED_NO_SIDECAR, DETACHED_SIDECAR_ERROR)


def detached_reason(exc: BaseException, environ: Mapping[str, str] | None = None) -> str:
    """The ``DETACHED_*`` reason a failed attachment (``exc``) stands for."""
    env = os.environ if environ is None else environ
    if ports.ENV_PORT not in env:  # the webhook sets it on every vLLM container it injects
        return DETACHED_NOT_INJECTED
    # EngineClient.connect wraps the socket error of a control port it cannot reach
    # (``raise ... from None`` keeps it as __context__); an answer that is no sidecar's,
    # or a local channel that fails after one, has none.
    if isinstance(exc.__context__, OSError):
        return DETACHED_NO_SIDECAR  # nothing listens, or it does not answer
    return DETACHED_SIDECAR_ERROR


def sidecar_address(offloading_spec: Any, host: str | None = None,
                    port: int | str | None = None,
                    environ: dict[str, str] | None = None) -> tuple[str, int]:
    """The pod sidecar's control address for this engine's DP rank.

    ``host``/``port`` from the tier entry win over ``VLLM_P2P_SIDE_CHANNEL_*``;
    the engine's global ``parallel.data_parallel_index`` is added to the port.
    """
    env = os.environ if environ is None else environ
    try:
        base = int(port) if port is not None else ports.env_base_port(env)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kv-offload tier: port {port!r} is not an integer; set the tier's "
                         f"'port' or {ports.ENV_PORT} to the sidecar's base control port"
                         if port is not None else f"kv-offload tier: {exc}") from None
    config = getattr(offloading_spec, "config", offloading_spec)
    dp_index = int(getattr(getattr(config, "parallel", None), "data_parallel_index", 0) or 0)
    try:
        return host or ports.env_host(env), ports.control_port(base, dp_index)
    except ValueError as exc:
        raise ValueError(f"kv-offload tier: {exc}, or the tier's 'port'") from None


class SidecarLink:
    """The EngineClient of this engine's sidecar, handed out only while the sidecar matches."""

    def __init__(self, address: tuple[str, int], engine: OffloadingConfig, chunk_bytes: int,
                 timeout: float, on_refused: Callable[[str | None], None],
                 client: Any = None, region: Any = None,
                 model_identity: ModelIdentity | None = None,
                 on_detached: Callable[[str | None], None] | None = None) -> None:
        self.address = address
        # Why no sidecar is attached (a ``DETACHED_*`` reason), or None once one is.
        self.detached: str | None = None
        self._on_detached = on_detached or (lambda reason: None)
        # This engine's model identity (``vllm_identity``: read from the VllmConfig building the
        # tier, unless given), stated to every sidecar attached.
        self.model_identity = model_identity or this_engine_identity(engine)
        # vLLM's primary rows to hand to each sidecar attached (an EngineClient RowRegion).
        self._region = region
        self._engine = engine
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout
        self._on_refused = on_refused
        # The seed this engine hashes prefixes with; None: ask vLLM at each check (vLLM
        # resolves it after building the tiers). The simulated engine sets its own.
        self.engine_hash_seed: str | None = None
        # Why the sidecar is refused (the differing fields), or None.
        self.refused: str | None = None
        # Connected lazily, so vLLM starts even before its sidecar.
        self._client = client
        self._lock = threading.Lock()
        self._next_connect = 0.0
        self._refusal_logged: str | None = None
        # The sidecar instance last found to match (None: not yet).
        self._checked_instance: str | None = None

    @property
    def instance(self) -> str | None:
        """The sidecar instance this link last found to match (None: none yet, or refused)."""
        return self._checked_instance

    @property
    def next_check(self) -> float:
        """When (``time.monotonic()``) the link will next try to reach or check its sidecar."""
        return self._next_connect

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def attach_early(self) -> None:
        """Connect (and hand over the region) now, checking nothing yet: vLLM resolves its hash
        seed only after building the tiers, so the check waits for the first ``connected()``."""
        with self._lock:
            if self._client is None:
                self._connect_locked()

    def _connect_locked(self) -> None:
        """A new EngineClient of the sidecar (handing it the region), not checked yet; on
        failure the link is detached and the next attempt waits ``RECONNECT_SECONDS``.
        Called with the lock held."""
        from kv_offload_sidecar.engine.client import EngineClient

        try:
            self._client = EngineClient.connect(*self.address, timeout=self._timeout,
                                                region=self._region,
                                                states=self.model_identity.statement(
                                                    self._engine.fingerprint))
        except Exception as exc:
            self._next_connect = time.monotonic() + RECONNECT_SECONDS
            self._detach(detached_reason(exc), exc)
            return
        self._checked_instance = None
        if self.detached is not None:
            logger.info("kv-offload tier: sidecar at %s:%d reached; no longer detached (%s)",
                        self.address[0], self.address[1], self.detached)
            self.detached = None
            self._on_detached(None)

    def _detach(self, reason: str, exc: BaseException) -> None:
        """Run without a sidecar; one warning per reason (the first, or a new one)."""
        if reason == self.detached:
            return
        self.detached = reason
        self._on_detached(reason)
        logger.warning(
            "kv-offload tier: running detached (%s): no kv-offload sidecar at %s:%d (%s); vLLM "
            "serves every request by recomputing, and this tier attaches when a sidecar "
            "answers (metric vllm:kv_offload_tier_detached{reason=%r} is 1 meanwhile)",
            reason, self.address[0], self.address[1], exc, reason)

    def connected(self) -> Any:
        """The EngineClient of a sidecar that matches this engine, or None while it is refused
        or detached (no sidecar answers).

        Connects at most once per second while the sidecar is away, and checks
        every sidecar it attaches to; a refused one is dropped and checked
        again every ``RECHECK_SECONDS`` (it may come back with the right config).
        """
        with self._lock:
            for _ in range(2):  # a second time after finding the sidecar restarted
                if self._client is None:
                    if time.monotonic() < self._next_connect:
                        return None  # refused, or detached: tried again at next_check
                    self._connect_locked()
                    if self._client is None:
                        return None
                if self._verify(self._client):
                    return self._client
                if self.refused is not None:
                    return None
            return None

    def cancel(self, jobs: list[str]) -> None:
        """Ask the sidecar to stop ``jobs`` now (through the client attached, without
        connecting or checking: a job runs only on a client that was)."""
        client = self._client  # read without the lock: connected() may hold it while connecting
        if client is not None:
            client.cancel(jobs)

    def matches(self, client: Any) -> bool:
        """Whether ``client`` is still attached to a sidecar instance that matches this engine.

        The client re-attaches to a restarted sidecar at an operation's start,
        so this runs after every operation too.
        """
        with self._lock:
            return client is self._client and self._verify(client)

    def matches_now(self, client: Any) -> bool:
        """``matches`` without waiting or asking the sidecar (for vLLM's own thread): True
        only while ``client`` is this link's and attached to the instance last checked."""
        checked = self._checked_instance  # attribute reads: no lock, which a connect may hold
        return (client is self._client and checked is not None
                and getattr(client, "instance", None) == checked)

    def ready_client(self) -> Any:
        """The client, when it can be used now without waiting (checked, attached as it is);
        else None (then the lookup thread connects, checks or re-attaches first)."""
        client = self._client
        if client is not None and getattr(client, "attached_now", False) and self.matches_now(client):
            return client
        return None

    def _verify(self, client: Any) -> bool:
        """Compare the sidecar's fingerprint, chunk size and hash seed with this engine's
        (once per sidecar instance). Called with the client lock held."""
        instance = getattr(client, "instance", None)
        if instance is not None and instance == self._checked_instance:
            return True
        info = client.info()
        if instance is not None and info.get("instance") != instance:
            # The sidecar restarted under this client's mapping: start afresh (and check that one).
            self._client, self._checked_instance, self._next_connect = None, None, 0.0
            client.close()
            return False
        seed = self.engine_hash_seed if self.engine_hash_seed is not None else vllm_hash_seed()
        differences = mismatches(self._engine, seed, info)
        self.refused = "; ".join(differences) if differences else None
        self._on_refused(self.refused)
        if not differences:
            self._checked_instance = instance
            self._refusal_logged = None
            logger.info("kv-offload tier: sidecar %s at %s:%d serves this engine's chunks "
                        "(fingerprint %s, %d bytes per chunk)", info.get("identity"),
                        self.address[0], self.address[1], info.get("fingerprint"),
                        self._chunk_bytes)
            return True
        refusal = refusal_message(self.address, differences)
        if refusal != self._refusal_logged:
            logger.error("%s", refusal)
            self._refusal_logged = refusal
        self._client, self._checked_instance = None, None
        self._next_connect = time.monotonic() + RECHECK_SECONDS
        client.close()
        return False
