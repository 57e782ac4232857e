"""From a vLLM deployment to the OffloadingConfig its engines build, standard library only.

``vllm_args`` parses the ``vllm serve`` command line, ``kv_cache_geometry``
derives the KV-cache layout vLLM builds from the model's config.json, and
``translate`` combines both the way vLLM's ``build_offloading_config`` does
(``translate`` for one engine's worker, ``pool_config`` for the pool's
ConfigMap). The operator, its webhook and ``kv-offload translate`` use them.
"""
