"""Where the engine computes, as the tier sees it from inside vLLM's process, and what follows
for its stores.

A store's copies out of vLLM's rows are background work. Where vLLM computes on the host's
CPU (vLLM's CPU platform), they share the cores and the memory bus the engine's decoding
uses: copied flat out, a 512 MiB store made the decoding request's inter-token p99 1.87x
quiet on the 2-core host it was measured on, 1.06x paced to a sixth of the copy rate
(``store.engine_region.STORE_COPY_SHARE``). Where vLLM computes on a GPU, its decoding does
not run on those cores, and pacing only delays a prefix becoming visible to peers (a
6 GiB prefix took 7-10 s paced). So the tier asks the sidecar to pace a store only when the
engine computes on the CPU (``paces_stores``), and then only while no other store waits.

Read from vLLM's own platform object, ``vllm.platforms.current_platform.device_type``
("cpu" on the CPU platform; "cuda", "rocm", "xpu", "tpu" elsewhere), taken from the modules
vLLM has already imported: the tier imports nothing of vLLM's. Where it cannot be read (a
process that is not vLLM, an engine too old to say), stores are paced: the side that keeps
an engine sharing the host's cores safe.
"""

from __future__ import annotations

import logging
import sys

# vLLM's device type of its CPU platform.
CPU_DEVICE_TYPE = "cpu"


def engine_device_type() -> str | None:
    """vLLM's ``current_platform.device_type`` in this process; None where vLLM's platforms
    module is not loaded or does not say."""
    platforms = sys.modules.get("vllm.platforms")
    if platforms is None:
        return None
    try:
        device_type = getattr(getattr(platforms, "current_platform", None), "device_type", None)
    except Exception:  # noqa: BLE001 (a platform that fails to resolve says nothing)
        return None
    return device_type if isinstance(device_type, str) and device_type else None


def paces_stores(device_type: str | None) -> bool:
    """Whether stores are paced for an engine computing on ``device_type`` (None: unknown)."""
    return device_type is None or device_type == CPU_DEVICE_TYPE


def engine_paces_stores(logger: logging.Logger) -> bool:
    """``paces_stores`` for the engine of this process, said once on ``logger``."""
    device_type = engine_device_type()
    paced = paces_stores(device_type)
    logger.info("kv-offload tier: the engine computes on %s: stores are %s", device_type or "an unknown device",
                "paced while no other store waits" if paced else "not paced")
    return paced


__all__ = ["CPU_DEVICE_TYPE", "engine_device_type", "engine_paces_stores", "paces_stores"]
