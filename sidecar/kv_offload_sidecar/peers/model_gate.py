"""Which model identity this sidecar shares under: the one its engine gave it.

The tier inside vLLM computes the engine's ``ModelIdentity`` from vLLM's own config and
the weights it loaded, and states it with every ``info`` of the local channel. The gate:
- before any engine stated one, the sidecar shares nothing: it dials no peer and its
  hello states no identity, so every peer refuses it (``model_mismatch``);
- refuses the identity of an engine of another fingerprint (that engine refuses the
  sidecar too: ``engine.sidecar_match``), so it never becomes the sidecar's;
- refuses an identity that contradicts the part the pool's ConfigMap declares
  (``model_identity.declared_mismatches``: the command line says ``--revision abc`` and
  the engine runs ``def``), so a pod whose config and engine disagree shares nothing;
- adopts the first identity that passes, for the sidecar's life (its store holds that
  engine's chunks); a later engine (another DP rank, a restarted vLLM container) with
  another identity is refused: restart the pod to serve other weights;
- answers each offer with "" (the engine may use this sidecar) or the refusal line, which
  the tier logs and the sidecar counts (``engine_refusals``) and logs once per distinct
  refusal.
Used on the sidecar's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity, declared_mismatches

if TYPE_CHECKING:
    from kv_offload_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

# Distinct refusal lines logged (each once); later distinct ones are only counted.
MAX_LOGGED_REFUSALS = 32


class ModelGate:
    """The adopted model identity and the engines refused."""

    def __init__(self, fingerprint: str, declared: Mapping[str, str],
                 metrics: SidecarMetrics | None = None, *, transport: str = "") -> None:
        # The pool's fingerprint (an engine of another one is not this sidecar's).
        self.fingerprint = fingerprint
        # The fields the pool's ConfigMap declares (the command line's part).
        self.declared = dict(declared)
        # The identity this sidecar shares under (None: no engine has stated one yet).
        self.identity: ModelIdentity | None = None
        # Set once an identity is adopted (peer links wait for it).
        self.known = asyncio.Event()
        # Counts refusals (engine_refusals) and shows the adopted digest (config_info).
        self._metrics = metrics
        self._transport = transport
        self._logged: set[str] = set()

    async def once_known(self, start: Callable[[], Awaitable[None]]) -> None:
        """``start()`` once an engine stated an identity (peer links: before, this sidecar has
        nothing to share and answers every handshake 503)."""
        if not self.known.is_set():
            log.info("waiting for the engine's model identity before dialling peers")
            await self.known.wait()
        await start()

    def offer(self, raw: Any, fingerprint: Any = None) -> str:
        """An engine states its identity (and its fingerprint, when it says it): "" when it may
        use this sidecar, else why not."""
        if fingerprint is not None and fingerprint != self.fingerprint:
            return self._refuse(f"the engine's fingerprint {str(fingerprint)[:32]!r} is not the "
                                f"pool's {self.fingerprint!r}: its identity is not adopted")
        try:
            identity = ModelIdentity.from_dict(raw)
        except ValueError as exc:
            return self._refuse(f"the engine's model identity is malformed: {exc}")
        declared = declared_mismatches(identity, self.declared)
        if declared:
            return self._refuse("the engine's model identity contradicts the pool's ConfigMap "
                                f"({'; '.join(declared)}): the ConfigMap was translated from "
                                f"another vllm serve line; re-translate it from this one")
        if self.identity is None:
            self.identity = identity
            self.known.set()
            if self._metrics is not None:
                self._metrics.set_config_info(fingerprint=self.fingerprint, transport=self._transport,
                                              model_identity=identity.digest)
            if identity.comparable:
                log.info("engine attached: model identity %s (%s); sharing with peers of the "
                         "same identity", identity.digest, identity.weights)
            else:
                log.warning("engine attached with weights that cannot be identified (model "
                            "identity %s): this pod shares no chunk with any peer", identity.digest)
            return ""
        if identity != self.identity:
            return self._refuse(f"an engine with another model identity attached "
                                f"({'; '.join(self.identity.diff(identity))}): this sidecar "
                                f"serves {self.identity.digest}'s chunks; restart the pod to "
                                f"serve other weights")
        return ""

    def view(self) -> dict[str, Any] | None:
        """The adopted identity with its digest, for /v1/status (None: none yet)."""
        if self.identity is None:
            return None
        return {"digest": self.identity.digest, **self.identity.to_dict()}

    def _refuse(self, why: str) -> str:
        if self._metrics is not None:
            self._metrics.engine_refusals.inc()
        if why not in self._logged and len(self._logged) < MAX_LOGGED_REFUSALS:
            self._logged.add(why)
            log.error("refusing the engine: %s", why)
        return why


__all__ = ["ModelGate"]
