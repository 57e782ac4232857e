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
- The data plane beside a GPU: where the pool chose no transport (``spec.sidecar.dataPlane``,
  ``transport_given``) and the vLLM container requests a GPU, the sidecar runs
  ``GPU_TRANSPORT`` (tcp), the only plane measured on a GPU, with the pool's lanes (unset: one
  per core of its CPU budget, so ``GPU_SIDECAR_CPU`` lanes). A pool mixing GPU and CPU-only
  pods sets ``dataPlane.transport``: its sidecars must share one plane.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from ..pools.pool_spec import GPU_SIDECAR_CPU, GPU_TRANSPORT, SidecarSpec
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
    gpu = requests_gpu(vllm)
    if not sidecar.transport_given and gpu:
        changes["transport"] = GPU_TRANSPORT
    if not sidecar.resources_given and gpu:
        resources = copy.deepcopy(dict(sidecar.resources))
        resources["requests"] = {**(resources.get("requests") or {}), "cpu": GPU_SIDECAR_CPU}
        changes["resources"] = resources
    return dataclasses.replace(sidecar, **changes) if changes else sidecar
