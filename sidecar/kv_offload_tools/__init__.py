"""Tools that never run in a pod (``pip install 'kv-offload[tools]'``; ``./dev`` installs them).

- ``local_pool`` (``LocalPool``) and ``sidecar_process`` (``SidecarProcess``): real
  ``kv-offload sidecar`` processes on this host, for tests, the demo, the benches and chaos;
  ``http_client`` and ``scrape``: their control API and ``/metrics`` as numbers.
- ``engine_sim`` and ``prefix_hash``: a simulated vLLM engine driving the tier as vLLM does.
- ``demo`` and ``mooncake_trace`` (the trace sample in ``data/``): ``kv-offload demo``.
- ``bench/``: ``kv-offload bench transport|replay|chaos|restarts|...``; ``shm_restarts``: a
  sidecar SIGKILLed under an engine client on a size-bounded tmpfs (``bench restarts``).
- ``chaos/``: the fault scenarios and fuzz targets behind ``kv-offload bench chaos``.
- ``vllm_harness/``: real vLLM on a CPU (``kv-offload demo --engine vllm``, tests/vllm).
"""
