"""What a pool's sidecar takes from the pod it joins where the pool leaves it unset.

Pure (no kopf, no I/O); ``pod_patch`` applies the result.

- The engine's ``/metrics``: where ``spec.sidecar.engineMetricsURL`` is unset, the vLLM
  container's own API server (its ``--host``, loopback where it binds every address, and
  ``--port``, vLLM's default 8000), so every sidecar learns its engine's prefill rate from
  vLLM (``peers/prefill_rate.py``) and fetch-or-recompute declines a peer's run that is slower
  to fetch than to recompute. An engine without an API server (``--headless`` ranks) leaves
  the sidecar on ``prefillTokensPerSecond``, with one warning in its log.
- The CPU request beside a GPU: where ``spec.sidecar.resources`` is unset and the vLLM
  container requests a GPU (a ``*/gpu`` extended resource, e.g. ``nvidia.com/gpu``), the
  sidecar requests ``GPU_SIDECAR_CPU`` instead of ``DEFAULT_SIDECAR_CPU``: its lanes follow its
  cores (``cpu_budget``), and with one lane a peer hit loses to recompute on a GPU. GPUs
  given through DRA claims are not seen: set ``spec.sidecar.resources`` there.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from ..pools.pool_spec import GPU_SIDECAR_CPU, SidecarSpec
from ..translation.vllm_args import VllmServeArgs


def requests_gpu(container: Mapping[str, Any]) -> bool:
    """True when ``container`` requests or limits a ``*/gpu`` extended resource above 0."""
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        for name, count in (resources.get(kind) or {}).items():
            if str(name).endswith("/gpu") and str(count).strip() not in ("0", ""):
                return True
    return False


def for_pod(sidecar: SidecarSpec, vllm: Mapping[str, Any], args: VllmServeArgs) -> SidecarSpec:
    """``sidecar`` with what the pool left unset taken from its vLLM container ``vllm``
    (``args``: its parsed command line)."""
    changes: dict[str, Any] = {}
    if not sidecar.engine_metrics_url:
        changes["engine_metrics_url"] = args.metrics_url()
    if not sidecar.resources_given and requests_gpu(vllm):
        resources = copy.deepcopy(dict(sidecar.resources))
        resources["requests"] = {**(resources.get("requests") or {}), "cpu": GPU_SIDECAR_CPU}
        changes["resources"] = resources
    return dataclasses.replace(sidecar, **changes) if changes else sidecar
