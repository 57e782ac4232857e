"""Tools that never run in a pod (``pip install 'kv-offload[tools]'``; ``./dev`` installs them).

- The shared harness (local pools, sidecar processes, simulated engines) is
  ``kv_offload_testing``, beside this package: the tests import it without the tools.
- ``demo`` and ``mooncake_trace`` (the trace sample in ``data/``): ``kv-offload demo``.
- ``bench/``: ``kv-offload bench transport|replay|chaos|restarts|...``, a folder per bench with
  several modules (``bench/scale/``: ``cli`` is what the command runs); ``shm_restarts``: a
  sidecar SIGKILLed under an engine client on a size-bounded tmpfs (``bench restarts``).
- ``chaos/``: the fault scenarios and fuzz targets behind ``kv-offload bench chaos``.
- ``vllm_harness/``: real vLLM on a CPU (``kv-offload demo --engine vllm``, tests/vllm).
"""
