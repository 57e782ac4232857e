"""The shared test harness: real sidecars on this host and simulated engines (never in the image).

Tests, the demo, the benches and chaos import it; it imports the sidecar's packages and
never the tools (tests/test_package_layout.py).

- ``local_pool`` (``LocalPool``) and ``sidecar_process`` (``SidecarProcess``): real
  ``kv-offload sidecar`` processes on this host; ``http_client`` and ``scrape``: their
  control API and ``/metrics`` as numbers; ``certs``: a pool's TLS certificates;
  ``frozen``: a process stopped, every thread of it (SIGSTOP returns before they are).
- ``engine_sim`` and ``prefix_hash``: a simulated vLLM engine driving the tier as vLLM does.
"""
