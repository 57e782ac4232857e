"""The sidecar package's subcommands of ``kv-offload``, one module each, named after its command.

``sidecar`` (run the per-pod sidecar), ``install-tier`` (copy the vLLM-side tier into a
shared volume), ``ucx-info`` (the UCX the sidecar loads) and ``admin-token`` (the admin
bearer token of a pool key file). Each exposes ``add_arguments(parser)`` and
``run(args) -> int`` for the ``kv-offload`` dispatcher (the operator package's ``cli``).
"""
