"""Where an engine finds its sidecar: vLLM's side-channel variables and the DP port rule, once.

The sidecar serves one control port per data-parallel rank its pod runs, at
``base + i`` where ``i`` is the rank's *global* data-parallel index; vLLM's
well-known ``VLLM_P2P_SIDE_CHANNEL_HOST``/``_PORT`` name the host and base.
"""

from __future__ import annotations

from collections.abc import Mapping

ENV_HOST = "VLLM_P2P_SIDE_CHANNEL_HOST"
ENV_PORT = "VLLM_P2P_SIDE_CHANNEL_PORT"
DEFAULT_HOST = "localhost"
DEFAULT_BASE_PORT = 5710


def control_port(base_port: int, dp_index: int) -> int:
    """The control port of global data-parallel index ``dp_index``; ValueError when out of range."""
    port = int(base_port) + int(dp_index)
    if not 0 < port <= 65535 or dp_index < 0:
        raise ValueError(f"base port {base_port} + DP index {dp_index} = {port} is not a valid "
                         f"port; set {ENV_PORT} (the base control port) lower")
    return port


def env_host(environ: Mapping[str, str], default: str = DEFAULT_HOST) -> str:
    return environ.get(ENV_HOST) or default


def env_base_port(environ: Mapping[str, str], default: int = DEFAULT_BASE_PORT) -> int:
    """``VLLM_P2P_SIDE_CHANNEL_PORT`` as an int (``default`` when unset); ValueError otherwise."""
    raw = environ.get(ENV_PORT, "")
    if raw == "":
        return default
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{ENV_PORT}={raw!r} is not a port number; set it to the sidecar's "
                         f"base control port (e.g. {DEFAULT_BASE_PORT})")
    return int(raw)
