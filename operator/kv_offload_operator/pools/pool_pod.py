"""A pool's pod as the operator reads it: its vLLM container and command line, and what injection names.

Pure (no kopf, no I/O), and below the webhook: ``pool_source`` finds the vLLM
container of a workload's pod template here the way the webhook finds it in a
pod (``find_vllm_container``), ``ready_peers`` recognises a running sidecar by
the names the webhook injects it with (``webhook.pod_patch`` uses the same ones).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

# Set on injected pods; its value is the pool fingerprint at injection time.
INJECTED_ANNOTATION = "kv-offload.io/injected"
# Optional pod annotation naming the vLLM container when it cannot be guessed.
VLLM_CONTAINER_ANNOTATION = "kv-offload.io/vllm-container"
# The injected native sidecar's container name.
SIDECAR_NAME = "kv-offload-sidecar"
# Name of the sidecar's first control port on every pod, whatever its DP start
# rank: the PodMonitor scrapes /metrics there. Other control ports: kvo-ctrl-<i>.
METRICS_PORT_NAME = "kvo-metrics"
# Extended resources that count a container's accelerators (one per engine worker).
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/xe", "gpu.intel.com/i915",
                         "habana.ai/gaudi")
# A command line starting with one of these and holding ``-c`` runs a shell script.
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash", "/usr/bin/env")


def container_accelerators(container: Mapping[str, Any]) -> int | None:
    """The accelerators a container's resources ask for (``ACCELERATOR_RESOURCES``, limits,
    else requests): its share of one node; None when it names none. ValueError for a
    count that is not an integer."""
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        amounts = resources.get(section) or {}
        counts = [amounts[name] for name in ACCELERATOR_RESOURCES if name in amounts]
        if counts:
            try:
                return sum(int(str(c)) for c in counts)
            except ValueError:
                raise ValueError(f"the vLLM container's resources.{section} name an accelerator "
                                 f"count that is not an integer: {counts!r}") from None
    return None


def container_argv(container: Mapping[str, Any]) -> list[str]:
    """The command line a container runs; ``sh -c "..."`` scripts are split."""
    argv = [str(a) for a in (container.get("command") or [])] + \
           [str(a) for a in (container.get("args") or [])]
    if argv and argv[0] in SHELLS and "-c" in argv:
        i = argv.index("-c")
        if i + 1 < len(argv):
            return shlex.split(argv[i + 1])
    return argv


def _runs_vllm(argv: Sequence[str]) -> bool:
    return any(a == "vllm" or a.endswith("/vllm") or a.startswith("vllm.") for a in argv)


def find_vllm_container(pod: Mapping[str, Any]) -> int:
    """Index of the vLLM container in ``spec.containers``; ValueError says how to name it."""
    containers = (pod.get("spec") or {}).get("containers") or []
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(VLLM_CONTAINER_ANNOTATION)
    if wanted:
        for i, c in enumerate(containers):
            if c.get("name") == wanted:
                return i
        raise ValueError(f"annotation {VLLM_CONTAINER_ANNOTATION}={wanted!r} names no container of the pod")
    candidates = [i for i, c in enumerate(containers) if _runs_vllm(container_argv(c))]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates and len(containers) == 1:
        return 0
    raise ValueError(f"cannot tell which container runs vLLM ({len(candidates)} candidates); "
                     f"set annotation {VLLM_CONTAINER_ANNOTATION}: <container name>")
