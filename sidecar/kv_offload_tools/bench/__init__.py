"""Benchmarks behind `kv-offload bench ...`: each prints ratios measured within one run.

A bench of several modules is a folder whose ``cli`` module (``add_arguments``, ``run``) is what
``kv-offload bench <name>`` runs (``BENCHES`` in ``kv_offload_operator/cli/__init__.py``); a bench
of one module (``chaos``, ``descriptors``, ``restarts``) is that module.
"""
