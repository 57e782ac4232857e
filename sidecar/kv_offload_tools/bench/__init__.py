"""Benchmarks behind `kv-offload bench ...`: each prints ratios measured within one run.

A bench of several modules is a folder whose ``cli`` module (``add_arguments``, ``run``) is what
``kv-offload bench <name>`` runs (``BENCHES`` in ``kv_offload_operator/cli/__init__.py``); a bench
of one module (``chaos``, ``descriptors``, ``restarts``) is that module.
"""

from __future__ import annotations

from kv_offload_sidecar.usage import UsageError


def require_host(bench: str, reason: str | None) -> None:
    """Refuse to run ``kv-offload bench <bench>`` where this host lacks what it needs: ``reason`` is
    why (one sentence, from the probe of what it needs, e.g. ``netns.ip.unavailable()``), None
    when the host has it; UsageError names the bench and the reason."""
    if reason:
        raise UsageError(f"kv-offload bench {bench}: {reason}")
